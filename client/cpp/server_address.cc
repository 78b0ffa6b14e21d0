#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "lossd/client/client.h"
#include "lossd/common/status_macros.h"

namespace lossd::client {
namespace {

// The name resolvers gRPC ships: a target that starts with one of these and a colon is a gRPC URI.
constexpr absl::string_view kGrpcSchemes[] = {"dns",  "unix",  "unix-abstract", "ipv4",
                                              "ipv6", "vsock", "xds",           "google-c2p"};

constexpr absl::string_view kExpected =
    "HOST:PORT or a gRPC target URI (dns:///HOST:PORT, ipv4:ADDR:PORT, unix:PATH)";

bool IsPort(absl::string_view text) {
  int port = 0;
  return !text.empty() && absl::ascii_isdigit(text[0]) && absl::SimpleAtoi(text, &port) &&
         port >= 1 && port <= 65535;
}

// "HOST", "HOST:PORT", "[V6]" or "[V6]:PORT" with a port given; false for anything else.
bool HasHostAndPort(absl::string_view address, bool* port_missing) {
  *port_missing = false;
  absl::string_view port;
  if (absl::StartsWith(address, "[")) {
    const size_t close = address.find(']');
    if (close == absl::string_view::npos || close == 1) return false;
    const absl::string_view rest = address.substr(close + 1);
    if (rest.empty()) {
      *port_missing = true;
      return false;
    }
    if (rest[0] != ':') return false;
    port = rest.substr(1);
  } else {
    const size_t colon = address.find(':');
    if (colon == absl::string_view::npos) {
      *port_missing = true;
      return false;
    }
    // Colons after the first: an IPv6 address without brackets, whose port cannot be told apart.
    if (colon == 0 || address.find(':', colon + 1) != absl::string_view::npos) return false;
    port = address.substr(colon + 1);
  }
  return IsPort(port);
}

}  // namespace

absl::Status CheckServerAddress(absl::string_view address, absl::string_view field) {
  const auto got = [&](absl::string_view why) {
    return InvalidField(field, kExpected, absl::StrCat("\"", address, "\"", why));
  };
  if (address.empty()) return InvalidField(field, kExpected, "an empty string");
  if (const size_t colon = address.find(':'); colon != absl::string_view::npos) {
    const std::string scheme = absl::AsciiStrToLower(address.substr(0, colon));
    for (absl::string_view known : kGrpcSchemes) {
      if (scheme == known) return absl::OkStatus();  // gRPC parses and resolves it
    }
  }
  if (const size_t separator = address.find("://"); separator != absl::string_view::npos) {
    absl::string_view authority = address.substr(separator + 3);
    authority = authority.substr(0, authority.find('/'));
    bool port_missing = false;
    const std::string suggestion = HasHostAndPort(authority, &port_missing)
                                       ? std::string(authority)
                                       : absl::StrCat(authority, ":", kDefaultServerPort);
    return got(absl::StrCat(", a URL: gRPC takes no http:// or https:// scheme (root ",
                            "certificates turn TLS on); give \"", suggestion, "\""));
  }
  bool port_missing = false;
  if (HasHostAndPort(address, &port_missing)) return absl::OkStatus();
  if (port_missing) {
    return got(absl::StrCat(", which has no port: lossd listens on ", kDefaultServerPort,
                            " unless its --listen says otherwise, as in \"", address, ":",
                            kDefaultServerPort, "\""));
  }
  if (absl::StrContains(address.substr(address.find(':') + 1), ':')) {
    return got(absl::StrCat(
        ": an IPv6 address goes in brackets, as in \"[::1]:", kDefaultServerPort, "\""));
  }
  return got(", which is not HOST:PORT with a port in [1, 65535]");
}

namespace {

// The gRPC scheme of one address ("dns", "unix", ...), lower-cased; empty for HOST:PORT.
std::string SchemeOf(absl::string_view address) {
  const size_t colon = address.find(':');
  if (colon == absl::string_view::npos) return "";
  const std::string scheme = absl::AsciiStrToLower(address.substr(0, colon));
  for (absl::string_view known : kGrpcSchemes) {
    if (scheme == known) return scheme;
  }
  return "";
}

// The host of one HOST:PORT, [V6]:PORT, dns: or ipv4:/ipv6: address, without brackets.
absl::string_view HostOf(absl::string_view address) {
  const std::string scheme = SchemeOf(address);
  if (scheme == "dns" || scheme == "ipv4" || scheme == "ipv6") {
    address.remove_prefix(address.find(':') + 1);
    const bool authority = absl::StartsWith(address, "//");
    while (absl::ConsumePrefix(&address, "/")) {
    }
    // dns://AUTHORITY/HOST:PORT
    if (const size_t slash = address.find('/');
        authority && scheme == "dns" && slash != absl::string_view::npos) {
      address.remove_prefix(slash + 1);
    }
  }
  if (absl::StartsWith(address, "[")) return address.substr(1, address.find(']') - 1);
  const size_t port = address.rfind(':');
  return port == absl::string_view::npos ? address : address.substr(0, port);
}

// Whether one address names this host: a Unix socket, or a loopback host.
bool IsLocalAddress(absl::string_view address) {
  const std::string scheme = SchemeOf(address);
  if (scheme == "unix" || scheme == "unix-abstract") return true;
  const absl::string_view host = HostOf(address);
  return host == "localhost" || host == "::1" || absl::StartsWith(host, "127.");
}

}  // namespace

absl::StatusOr<Target> ParseTarget(absl::string_view address) {
  RETURN_IF_ERROR(CheckServerAddress(address, "address"));
  Target target;
  target.uri = std::string(address);
  const size_t colon = address.find(':');
  const std::string scheme = absl::AsciiStrToLower(address.substr(0, colon));
  if (colon != absl::string_view::npos && (scheme == "ipv4" || scheme == "ipv6")) {
    // ipv4:ADDR:PORT,ADDR:PORT or, as a URI with an empty authority, ipv4:///ADDR:PORT,...
    absl::string_view list = address.substr(colon + 1);
    while (absl::ConsumePrefix(&list, "/")) {
    }
    target.listed_addresses = 0;
    for (const absl::string_view entry : absl::StrSplit(list, ',')) {
      if (entry.empty()) {
        return InvalidField(
            "address", absl::StrCat("ADDR:PORT entries separated by commas after ", scheme, ":"),
            absl::StrCat("\"", address, "\""));
      }
      ++target.listed_addresses;
    }
    target.local = target.listed_addresses == 1 && IsLocalAddress(list);
    return target;
  }
  target.local = IsLocalAddress(address);
  return target;
}

std::optional<std::string> TcpHost(const Target& target) {
  if (target.listed_addresses != 1) return std::nullopt;
  const std::string scheme = SchemeOf(target.uri);
  if (!scheme.empty() && scheme != "dns" && scheme != "ipv4" && scheme != "ipv6") {
    return std::nullopt;
  }
  const absl::string_view host = HostOf(target.uri);
  if (host.empty()) return std::nullopt;
  return std::string(host);
}

}  // namespace lossd::client
