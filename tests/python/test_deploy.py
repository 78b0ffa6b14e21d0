"""The deployment and observability files (deploy/) checked against the real thing.

- promtool: the Prometheus config (its rule files resolve), the rules, the rules' unit tests.
- Every YAML and JSON file parses; the PrometheusRule is the rules file, wrapped.
- Live: a real lossd_server serves Compute, Step and an over-budget call; every lossd_* metric and
  label that the dashboard and the rules use must be in its /metrics, so they cannot silently rot.
  A real Prometheus with deploy/prometheus/prometheus.yml (targets and intervals swapped) scrapes
  it, a second server that has served nothing and, in the config's prometheus job, itself; it
  evaluates every rule without error and answers every dashboard query with data. "Servers up"
  counts the lossd servers only, and the panels of events show 0 for the fresh server.
- The container health check answers SERVING.
- Consistency: every --flag in the Dockerfile, compose and Kubernetes files exists in
  `lossd_server --helpfull`; ports agree across flags, EXPOSE, compose, probes, Services,
  ServiceMonitor, pod annotations and the scrape target; grace periods exceed --drain_seconds.
- Scoring replicas: a RollingUpdate Deployment ready on gRPC health, a headless Service that
  selects only its pods, and an HPA on the metric the Prometheus adapter's rule serves, whose
  query a real Prometheus answers from the live server's series.
- README's "Operating lossd" documents every flag (with its default), metric and alert.
"""
import glob
import json
import os
import re
import runpy
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

import grpc
import numpy as np
import pytest
import yaml

from server_process import SERVER_BIN, ServerProcess, free_port, generate_stubs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEPLOY = os.path.join(REPO, "deploy")
PROMETHEUS_DIR = os.path.join(DEPLOY, "prometheus")
RULES = os.path.join(PROMETHEUS_DIR, "lossd_rules.yml")
DASHBOARD = os.path.join(DEPLOY, "grafana", "lossd-dashboard.json")
DOCKERFILE = os.path.join(DEPLOY, "docker", "Dockerfile")
COMPOSE = os.path.join(DEPLOY, "docker", "compose.yml")
K8S = os.path.join(DEPLOY, "k8s")
# The Prometheus Operator labels a pod's series with its namespace and pod, which the Prometheus
# adapter's rule maps to Kubernetes objects: the test's servers stand for two scoring pods.
NAMESPACE = "lossd"
PODS = ("lossd-scoring-0", "lossd-scoring-1")

VOCAB, HIDDEN = 4000, 64


def load_yaml(path):
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


def load_k8s(name):
    with open(os.path.join(K8S, name), encoding="utf-8") as f:
        return [doc for doc in yaml.safe_load_all(f) if doc]


def promtool(*args):
    result = subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"promtool {' '.join(args)}:\n{result.stdout}{result.stderr}"
    return result.stdout


def rules():
    return [rule for group in load_yaml(RULES)["groups"] for rule in group["rules"]]


def adapter_rules():
    """The Prometheus adapter's rules, from the config.yaml its ConfigMap holds."""
    (config_map,) = load_k8s("prometheus-adapter.yaml")
    return yaml.safe_load(config_map["data"]["config.yaml"])["rules"]


def render_adapter_query(template, series, group_by="pod"):
    """An adapter query as the adapter sends it when the HPA asks about PODS (its Go template:
    <<.Series>>, <<.LabelMatchers>>, <<.GroupBy>>)."""
    matchers = f'namespace="{NAMESPACE}",pod=~"{"|".join(PODS)}"'
    query = (template.replace("<<.Series>>", series).replace("<<.LabelMatchers>>", matchers)
             .replace("<<.GroupBy>>", group_by))
    assert "<<" not in query, query
    return query


def dashboard():
    with open(DASHBOARD, encoding="utf-8") as f:
        return json.load(f)


def dashboard_panels():
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def dashboard_exprs():
    return [t["expr"] for p in dashboard_panels() for t in p.get("targets", [])]


def template_queries():
    return [v["definition"] for v in dashboard()["templating"]["list"] if v["type"] == "query"]


def metric_names(expr):
    """lossd_* metric names in a PromQL expression (recording-rule names, with colons, excluded)."""
    return set(re.findall(r"(?<![\w:])(lossd_\w+)(?![\w:])", expr))


def selectors(expr):
    """(metric, [(label, op, value)]) for every lossd_*{...} selector in an expression."""
    out = []
    for name, body in re.findall(r"(?<![\w:])(lossd_\w+)\{([^}]*)\}", expr):
        matchers = re.findall(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"', body)
        out.append((name, matchers))
    return out


# --- promtool and file formats ------------------------------------------------------------------

def test_promtool_check_config_resolves_rule_files():
    out = promtool("check", "config", os.path.join(PROMETHEUS_DIR, "prometheus.yml"))
    assert "1 rule files found" in out, out


def test_promtool_check_rules():
    promtool("check", "rules", RULES)


def test_promtool_unit_tests_of_rules():
    promtool("test", "rules", os.path.join(PROMETHEUS_DIR, "lossd_rules_test.yml"))


def test_every_alert_is_labelled_annotated_and_tested_both_ways():
    alerts = [r for r in rules() if "alert" in r]
    assert len(alerts) >= 10
    cases = {}
    for test in load_yaml(os.path.join(PROMETHEUS_DIR, "lossd_rules_test.yml"))["tests"]:
        for case in test.get("alert_rule_test", []):
            cases.setdefault(case["alertname"], []).append(case.get("exp_alerts") or [])
    for alert in alerts:
        name = alert["alert"]
        assert re.fullmatch(r"\d+[smh]", alert.get("for", "")), f"{name}: no for:"
        assert alert["labels"]["severity"] in ("critical", "warning"), name
        assert alert["annotations"]["summary"].strip(), name
        assert len(alert["annotations"]["description"]) > 80, f"{name}: description without a hint"
        assert any(cases.get(name, [])), f"{name}: no test where it fires"
        assert any(not c for c in cases.get(name, [])), f"{name}: no test where it stays quiet"


def test_every_yaml_and_json_file_parses():
    files = [f for f in glob.glob(os.path.join(DEPLOY, "**", "*"), recursive=True) if os.path.isfile(f)]
    parsed = 0
    for path in files:
        with open(path, encoding="utf-8") as f:
            if path.endswith((".yml", ".yaml")):
                docs = [d for d in yaml.safe_load_all(f) if d is not None]
                assert docs and all(isinstance(d, dict) for d in docs), path
                parsed += 1
            elif path.endswith(".json"):
                assert isinstance(json.load(f), dict), path
                parsed += 1
    assert parsed >= 12


def test_prometheusrule_is_the_rules_file_wrapped():
    render = runpy.run_path(os.path.join(K8S, "make-prometheusrule.py"))["render"]
    with open(os.path.join(K8S, "prometheusrule.yaml"), encoding="utf-8") as f:
        assert f.read() == render(), \
            "deploy/k8s/prometheusrule.yaml is stale: run python3 deploy/k8s/make-prometheusrule.py"
    (rule,) = load_k8s("prometheusrule.yaml")
    assert rule["kind"] == "PrometheusRule"
    assert rule["spec"]["groups"] == load_yaml(RULES)["groups"]


def test_dashboard_is_a_grafana_dashboard():
    d = dashboard()
    assert d["uid"] and d["title"] and d["schemaVersion"] >= 36
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    titles = [p["title"] for p in dashboard_panels()]
    assert len(titles) == len(set(titles)), "panel titles repeat"
    for panel in d["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24 and pos["h"] > 0, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
            assert target["expr"].strip(), panel["title"]
    # What the dashboard must show.
    text = json.dumps(d)
    for needed in ("lossd_memory_bytes", "lossd_device_memory_used_bytes",
                   "lossd_device_memory_total_bytes", "lossd_tokens_total",
                   "lossd_received_bytes_total", "lossd_sent_bytes_total",
                   "lossd_request_seconds_bucket", "lossd_compute_seconds_bucket",
                   "lossd_queue_seconds_bucket", "lossd_queue_depth", "lossd_inflight_calls",
                   "lossd_requests_total", "lossd_logits_bytes_avoided_total", "lossd_head_version",
                   "lossd_host_buffer_bytes", "lossd_shared_memory_mapped_bytes"):
        assert needed in text, needed
    # Colon names are recording rules: they must be defined.
    recorded = {r["record"] for r in rules() if "record" in r}
    for expr in dashboard_exprs():
        for name in re.findall(r"\b[a-z_]+:[a-z0-9_]+:[a-z0-9_]+\b", expr):
            assert name in recorded, name


def test_grafana_provisioning_matches_compose():
    compose = load_yaml(COMPOSE)
    grafana = compose["services"]["grafana"]
    mounts = dict(v.split(":")[:2] for v in grafana["volumes"] if v.startswith(".."))
    compose_dir = os.path.dirname(COMPOSE)
    for source in mounts:
        assert os.path.exists(os.path.join(compose_dir, source)), source
    dashboard_mount = mounts["../grafana/lossd-dashboard.json"]
    assert mounts["../grafana/provisioning"] == "/etc/grafana/provisioning"
    (provider,) = load_yaml(os.path.join(DEPLOY, "grafana", "provisioning", "dashboards",
                                         "lossd.yml"))["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"] == os.path.dirname(dashboard_mount)
    assert grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == dashboard_mount
    (source,) = load_yaml(os.path.join(DEPLOY, "grafana", "provisioning", "datasources",
                                       "prometheus.yml"))["datasources"]
    assert source["type"] == "prometheus" and source["isDefault"]
    url = urllib.parse.urlsplit(source["url"])
    assert url.hostname in compose["services"], url
    assert f"{url.port}:{url.port}" in compose["services"][url.hostname]["ports"]
    prometheus = compose["services"]["prometheus"]
    prom_mounts = dict(v.split(":")[:2] for v in prometheus["volumes"] if v.startswith(".."))
    assert prom_mounts["../prometheus"] == "/etc/prometheus"
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]


# --- the live server ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stubs(tmp_path_factory):
    generate_stubs(os.path.join(REPO, "proto"), str(tmp_path_factory.mktemp("stubs")))
    from lossd.v1 import lossd_pb2, lossd_pb2_grpc
    return lossd_pb2, lossd_pb2_grpc


@pytest.fixture(scope="module")
def server():
    # A 2 MiB compute budget admits 32-token training calls on the demo head and refuses 256.
    with ServerProcess("--device=cpu", f"--demo_vocab_size={VOCAB}", f"--demo_hidden_size={HIDDEN}",
                       "--compute_memory_mib=2") as s:
        yield s


def compute(stub, pb, n, train):
    rng = np.random.default_rng(n)
    hidden = rng.standard_normal((n, HIDDEN), dtype=np.float32)
    start = pb.ComputeStart(head="demo", num_tokens=n, hidden_size=HIDDEN, hidden_dtype=pb.DTYPE_FLOAT32,
                            labels=rng.integers(0, VOCAB, n).tolist(),
                            outputs=pb.OutputSelection(grad_hidden=train, accumulate_grad_weight=train))
    requests = [pb.ComputeRequest(start=start), pb.ComputeRequest(chunk=pb.ComputeChunk(hidden=hidden.tobytes()))]
    return list(stub.Compute(iter(requests), timeout=600))


def scrape(server):
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=600) as r:
        return r.read().decode()


@pytest.fixture(scope="module")
def exposition(server, stubs):
    """/metrics after a training call, a scoring call, an optimizer step and an over-budget call,
    so that every labelled family has a child."""
    pb, pb_grpc = stubs
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.LossServiceStub(channel)
        assert compute(stub, pb, 32, train=True)[-1].HasField("summary")
        assert compute(stub, pb, 32, train=False)[-1].HasField("summary")
        stub.Step(pb.StepRequest(head="demo", sgd=pb.SgdConfig(learning_rate=0.01)), timeout=600)
        with pytest.raises(grpc.RpcError) as refused:
            compute(stub, pb, 256, train=True)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    return scrape(server)


def exported(text):
    """{family: (type, {label: {values}})} from a Prometheus text exposition."""
    families = {}
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        families[name] = (kind, {})
    for name, labels in re.findall(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})? \S+$", text, re.M):
        family = name
        if family not in families:
            for suffix in ("_bucket", "_sum", "_count"):
                if name.endswith(suffix) and name[:-len(suffix)] in families:
                    family = name[:-len(suffix)]
        for key, value in re.findall(r'(\w+)="([^"]*)"', labels or ""):
            families.setdefault(family, ("untyped", {}))[1].setdefault(key, set()).add(value)
    return families


def family_of(name, families):
    """The exported family a referenced sample name belongs to, or None: NAME itself, or a
    histogram's NAME_bucket / NAME_sum / NAME_count."""
    if name in families:
        return name
    for suffix in ("_bucket", "_sum", "_count"):
        base = name[:-len(suffix)]
        if name.endswith(suffix) and families.get(base, ("",))[0] == "histogram":
            return base
    return None


def referenced_exprs():
    return ([("dashboard", e) for e in dashboard_exprs() + template_queries()]
            + [(r.get("alert") or r["record"], r["expr"]) for r in rules()]
            + [(f"adapter rule {r['name']['as']}", q) for r in adapter_rules()
               for q in (r["seriesQuery"], r["metricsQuery"])])


def test_dashboard_and_rules_use_only_exported_metrics(exposition):
    families = exported(exposition)
    used = set()
    for where, expr in referenced_exprs():
        for name in metric_names(expr):
            assert family_of(name, families), f"{where}: {name} is not exported by lossd_server"
            used.add(family_of(name, families))
    assert len(used) >= 15, used


def test_selectors_use_exported_labels(exposition):
    families = exported(exposition)
    for where, expr in referenced_exprs():
        for name, matchers in selectors(expr):
            family = family_of(name, families)
            labels = dict(families[family][1])
            if name.endswith("_bucket"):
                labels.setdefault("le", {"+Inf"})
            for label, op, value in matchers:
                if label in ("job", "instance", "namespace", "pod"):  # target labels
                    continue
                assert label in labels, f"{where}: {name} has no label {label} (has {sorted(labels)})"
                if op == "=":
                    assert value in labels[label], f"{where}: {name}{{{label}=\"{value}\"}} never exported"


def api(port, path, **params):
    url = f"http://127.0.0.1:{port}/api/v1/{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params, doseq=True)
    try:
        with urllib.request.urlopen(url, timeout=600) as r:
            body = json.load(r)
    except urllib.error.HTTPError as e:
        body = json.load(e)
    assert body["status"] == "success", (params, body)
    return body["data"]


@pytest.fixture(scope="module")
def fresh_server():
    """A server that has served nothing: what a dashboard shows before the first event."""
    with ServerProcess("--device=cpu", "--demo_vocab_size=100", "--demo_hidden_size=8") as s:
        yield s


def target_of(server):
    return f"127.0.0.1:{server.metrics_port}"


@pytest.fixture(scope="module")
def prometheus(server, exposition, fresh_server):
    """A real Prometheus with deploy/prometheus/prometheus.yml, intervals shortened: its lossd job
    scrapes both servers, its prometheus job Prometheus itself, a target that is not lossd. Yields
    Prometheus's port once both lossd targets have been scraped enough for rate() and every rule
    has been evaluated after that."""
    config = load_yaml(os.path.join(PROMETHEUS_DIR, "prometheus.yml"))
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [os.path.join(PROMETHEUS_DIR, f) for f in config["rule_files"]]
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert set(jobs) == {"lossd", "prometheus"}, "the test scrapes both jobs of prometheus.yml"
    port = free_port()
    # Each lossd server as a pod of the scoring Deployment, as the Prometheus Operator labels it.
    jobs["lossd"]["static_configs"] = [
        {"targets": [target_of(s)], "labels": {"namespace": NAMESPACE, "pod": pod}}
        for s, pod in zip((server, fresh_server), PODS)]
    jobs["prometheus"]["static_configs"] = [{"targets": [f"127.0.0.1:{port}"]}]
    for job in jobs.values():
        job.update(scrape_interval="1s", scrape_timeout="1s")
    work = tempfile.mkdtemp(prefix="lossd-deploy-prometheus-")
    with open(os.path.join(work, "prometheus.yml"), "w") as f:
        yaml.safe_dump(config, f)
    process = subprocess.Popen(
        ["prometheus", f"--config.file={work}/prometheus.yml", f"--storage.tsdb.path={work}/data",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # Enough scrapes for rate() and rule evaluations after them.
        deadline = time.monotonic() + 600  # a hang guard: a loaded machine scrapes late
        ready = False
        while time.monotonic() < deadline and not ready:
            time.sleep(0.5)
            try:
                samples = api(port, "query",
                              query='count_over_time(up{job="lossd"}[1m]) >= 4')["result"]
                groups = api(port, "rules")["groups"]
            except OSError:
                continue
            evaluated = [r for g in groups for r in g["rules"]
                         if not r.get("lastEvaluation", "0001").startswith("0001")]
            ready = len(samples) == 2 and len(evaluated) == len(rules())
        assert ready, "Prometheus did not scrape both servers and evaluate every rule in time"
        # One more evaluation of every rule, after the scrapes that rate() needs.
        def evaluations():
            return {(g["name"], r["name"]): r.get("lastEvaluation")
                    for g in api(port, "rules")["groups"] for r in g["rules"]}
        seen = evaluations()
        while any(seen[rule] == at for rule, at in evaluations().items()):
            assert time.monotonic() < deadline, "Prometheus stopped evaluating its rules"
            time.sleep(0.2)
        yield port
    finally:
        process.terminate()
        process.wait(timeout=600)
        shutil.rmtree(work, ignore_errors=True)


def dashboard_query(expr, job, instance):
    """expr as Grafana sends it: its variables substituted (All is the variables' allValue, .*)."""
    return (expr.replace("$__rate_interval", "1m").replace("$__range", "1m")
            .replace("$job", job).replace("$instance", instance))


def only_dots_escaped(target):
    return target.replace(".", "\\\\.")


def test_real_prometheus_evaluates_rules_and_dashboard_queries(server, prometheus):
    for group in api(prometheus, "rules")["groups"]:
        for rule in group["rules"]:
            assert rule["health"] == "ok", f"{rule['name']}: {rule.get('lastError')}"
    for rule in rules():
        if "record" in rule:
            assert api(prometheus, "query", query=rule["record"])["result"], \
                f"{rule['record']}: no data"
    firing = {a["labels"]["alertname"] for a in api(prometheus, "alerts")["alerts"]}
    assert not firing & {"LossdDown", "LossdTargetMissing"}, firing

    target = target_of(server)
    for panel in dashboard_panels():
        for t in panel["targets"]:
            query = dashboard_query(t["expr"], "lossd", only_dots_escaped(target))
            data = api(prometheus, "query", query=query)
            assert data["result"], f"dashboard panel {panel['title']!r}: no data for {t['expr']}"
    assert "lossd" in api(prometheus, "label/job/values", **{"match[]": "lossd_build_info"})
    instances = api(prometheus, "label/instance/values",
                    **{"match[]": 'lossd_build_info{job=~"lossd"}'})
    assert target in instances


def test_prometheus_adapter_rule_serves_the_hpa_metric(prometheus):
    """The scoring HPA's metric, as the Prometheus adapter discovers and queries it: one value
    per pod."""
    for rule in adapter_rules():
        name = rule["name"]["as"]
        series = api(prometheus, "series", **{"match[]": rule["seriesQuery"]})
        assert series, f"adapter rule {name}: seriesQuery finds no series"
        (series_name,) = {s["__name__"] for s in series}
        assert re.fullmatch(rule["name"]["matches"], series_name)
        query = render_adapter_query(rule["metricsQuery"], series_name)
        result = api(prometheus, "query", query=query)["result"]
        assert sorted(r["metric"].get("pod") for r in result) == list(PODS), (name, result)
        assert all(r["metric"].keys() == {"pod"} for r in result), (name, result)
        assert all(float(r["value"][1]) >= 0 for r in result), (name, result)


def panel(title):
    (found,) = [p for p in dashboard_panels() if p["title"] == title]
    return found


def values(prometheus, expr, job, instance):
    result = api(prometheus, "query", query=dashboard_query(expr, job, instance))["result"]
    return [float(r["value"][1]) for r in result]


def test_servers_up_counts_lossd_servers_only(prometheus, server):
    (up,) = panel("Servers up")["targets"]
    # Three targets are up, one of them Prometheus itself: with Job and Instance "All", two.
    assert len(api(prometheus, "query", query="up == 1")["result"]) == 3
    assert values(prometheus, up["expr"], ".*", ".*") == [2.0]
    assert values(prometheus, up["expr"], "lossd", only_dots_escaped(target_of(server))) == [1.0]
    assert values(prometheus, up["expr"], "prometheus", ".*") == [0.0]


def test_panels_of_events_show_zero_before_the_first_event(prometheus, fresh_server):
    """A server that has refused nothing shows 0 refusals, not "No data". Every panel except
    latency quantiles (no requests have no latency) answers for the fresh server; the counts of
    events none of which happened are 0."""
    fresh = only_dots_escaped(target_of(fresh_server))
    for p in dashboard_panels():
        for t in p["targets"]:
            if "histogram_quantile" in t["expr"]:
                continue
            assert values(prometheus, t["expr"], ".*", fresh), \
                f"dashboard panel {p['title']!r}: no data for a fresh server: {t['expr']}"
    for title in ("Tokens / s", "Failed requests", "Tokens / s by kind", "Requests / s by method",
                  "Errors / s by code", "Refused calls", "Optimizer steps / s",
                  "Logits not materialized", "Logits memory saved for clients"):
        for t in panel(title)["targets"]:
            assert values(prometheus, t["expr"], ".*", fresh) == [0.0], (title, t["expr"])


def test_container_healthcheck_reports_serving(server):
    script = os.path.join(DEPLOY, "docker", "healthcheck.py")
    # The probe's own limit (3 s by default, as a container's) is a hang guard here: a loaded
    # machine may take longer to answer, which says nothing about the server's health.
    ok = subprocess.run(["/usr/bin/python3", script, f"--address={server.address}",
                         "--timeout=600"], capture_output=True, text=True, timeout=600)
    assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stdout + ok.stderr
    down = subprocess.run(["/usr/bin/python3", script, f"--address=127.0.0.1:{free_port()}",
                           "--timeout=2"], capture_output=True, text=True, timeout=600)
    assert down.returncode == 1, down.stdout + down.stderr


def test_runtime_packages_cover_the_server():
    result = subprocess.run([os.path.join(DEPLOY, "docker", "runtime-packages.sh"), SERVER_BIN],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    packages = result.stdout.split()
    for needed in ("grpc", "protobuf", "absl", "prometheus-cpp", "openblas"):
        assert any(needed in p for p in packages), (needed, packages)
    assert not [p for p in packages if p.endswith("-dev")], packages


# --- flags and ports across the Dockerfile, compose and Kubernetes --------------------------------

def server_flags():
    """{flag: default} of lossd_server, from --helpfull (--helpfull: every flag, whatever file defines it)."""
    text = subprocess.run([SERVER_BIN, "--helpfull"], capture_output=True, text=True, timeout=600).stdout
    flags = dict(re.findall(r"^\s+--(\w+) \(.*?\);\s+default: (.*?);$", text, re.M | re.S))
    assert {"listen", "metrics_listen", "drain_seconds", "device"} <= set(flags), text
    return flags


def main_cc_flags():
    """{flag: default} of the flags server/main.cc defines."""
    text = subprocess.run([SERVER_BIN, "--helpfull"], capture_output=True, text=True, timeout=600).stdout
    section = re.search(r"Flags from lossd_server:\n(.*?)(?:\n\n|\Z)", text, re.S).group(1)
    return {k: v.strip('"') for k, v in re.findall(r"--(\w+) \(.*?\);\s+default: (.*?);", section, re.S)}


def dockerfile():
    """[(INSTRUCTION, arguments)] with continuation lines joined."""
    with open(DOCKERFILE, encoding="utf-8") as f:
        text = re.sub(r"\\\n(\s*#.*\n)*", " ", f.read())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            instruction, _, rest = line.partition(" ")
            out.append((instruction.upper(), rest.strip()))
    return out


def docker_command():
    """The image's lossd_server command line: ENTRYPOINT + CMD."""
    instructions = dict(dockerfile())
    return json.loads(instructions["ENTRYPOINT"]), json.loads(instructions["CMD"])


def flag_values(args):
    values = {}
    for arg in args:
        if arg.startswith("--"):
            name, _, value = arg[2:].partition("=")
            values[name] = value
    return values


def port_of(address):
    return int(address.rsplit(":", 1)[1])


# The lossd_server Deployments and the Service in front of each: training, scoring replicas.
DEPLOYMENTS = {"deployment.yaml": "service.yaml", "scoring-deployment.yaml": "scoring-service.yaml"}


def k8s_container(name="deployment.yaml"):
    (deployment,) = load_k8s(name)
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return deployment, container


# The replica group that trains one head: a headless Service and a StatefulSet in one file.
REPLICA_GROUP = "training-replicas.yaml"


def replica_group():
    """(Service, StatefulSet, its lossd container) of REPLICA_GROUP."""
    docs = {doc["kind"]: doc for doc in load_k8s(REPLICA_GROUP)}
    assert set(docs) == {"Service", "StatefulSet", "NetworkPolicy"}, REPLICA_GROUP
    (container,) = docs["StatefulSet"]["spec"]["template"]["spec"]["containers"]
    return docs["Service"], docs["StatefulSet"], container


def command_lines():
    """Every lossd_server command line in deploy/, as (where, flag values)."""
    entrypoint, cmd = docker_command()
    compose = load_yaml(COMPOSE)["services"]["lossd"]
    return ([("Dockerfile", flag_values(entrypoint[1:] + cmd)),
             ("compose.yml", flag_values(entrypoint[1:] + compose["command"]))]
            + [(name, flag_values(k8s_container(name)[1]["args"])) for name in DEPLOYMENTS]
            + [(REPLICA_GROUP, flag_values(replica_group()[2]["args"]))])


def test_every_flag_exists():
    known = server_flags()
    for where, values in command_lines():
        for name in values:
            assert name in known, f"{where}: lossd_server has no flag --{name}"
    assert docker_command()[0][0] == "/opt/lossd/bin/lossd_server"
    for name in DEPLOYMENTS:
        _, container = k8s_container(name)
        assert container["command"] == [docker_command()[0][0]], name


def test_ports_agree_everywhere():
    entrypoint, _ = docker_command()
    grpc_port = port_of(flag_values(entrypoint)["listen"])
    metrics_port = port_of(flag_values(entrypoint)["metrics_listen"])
    for where, values in command_lines():
        # Reachable from outside the container or pod, on the same ports everywhere.
        assert values["listen"] == f"0.0.0.0:{grpc_port}", where
        assert values["metrics_listen"] == f"0.0.0.0:{metrics_port}", where

    instructions = dockerfile()
    exposed = {int(p) for i, rest in instructions if i == "EXPOSE" for p in rest.split()}
    assert exposed == {grpc_port, metrics_port}
    (health,) = [rest for i, rest in instructions if i == "HEALTHCHECK"]
    health_cmd = json.loads(health[health.index("CMD") + 3:])
    assert port_of(flag_values(health_cmd)["address"]) == grpc_port
    assert any(health_cmd[1] in rest for i, rest in instructions if i == "RUN"), "healthcheck.py not installed"

    compose = load_yaml(COMPOSE)
    published = {int(p.split(":")[-1]) for p in compose["services"]["lossd"]["ports"]}
    assert published == {grpc_port, metrics_port}
    (job,) = [j for j in load_yaml(os.path.join(PROMETHEUS_DIR, "prometheus.yml"))["scrape_configs"]
              if j["job_name"] == "lossd"]
    (static_target,) = job["static_configs"][0]["targets"]
    host, port = static_target.rsplit(":", 1)
    assert host in compose["services"] and int(port) == metrics_port

    (monitor,) = load_k8s("servicemonitor.yaml")
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    for deployment_file, service_file in DEPLOYMENTS.items():
        deployment, container = k8s_container(deployment_file)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports == {"grpc": grpc_port, "metrics": metrics_port}, deployment_file
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert container[probe]["grpc"]["port"] == grpc_port, (deployment_file, probe)
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert int(annotations["prometheus.io/port"]) == metrics_port
        assert annotations["prometheus.io/path"] == job["metrics_path"] == "/metrics"

        (service,) = load_k8s(service_file)
        service_ports = {p["name"]: p for p in service["spec"]["ports"]}
        for name, p in service_ports.items():
            target = p["targetPort"]
            target_port = ports[target] if isinstance(target, str) else target
            assert target_port == p["port"] == ports[name], (service_file, name)
        assert service_ports[endpoint["port"]]["port"] == metrics_port, service_file


def pod_labels(deployment_file):
    deployment, _ = k8s_container(deployment_file)
    return deployment["spec"]["template"]["metadata"]["labels"]


def test_selectors_names_and_volumes_agree():
    (monitor,) = load_k8s("servicemonitor.yaml")
    for deployment_file, service_file in DEPLOYMENTS.items():
        deployment, _ = k8s_container(deployment_file)
        labels = pod_labels(deployment_file)
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
        (service,) = load_k8s(service_file)
        assert service["spec"]["selector"].items() <= labels.items(), service_file
        # Each Service reaches its own pods only: a training client never lands on a scoring
        # replica, nor a scoring client on the training server.
        for other_deployment, other_service in DEPLOYMENTS.items():
            if other_service != service_file:
                other_pods = pod_labels(other_deployment).items()
                assert not service["spec"]["selector"].items() <= other_pods
        # The ServiceMonitor scrapes both, and under the Operator the job label is the value of
        # its jobLabel on the Service: the alert rules select job="lossd".
        service_labels = service["metadata"]["labels"]
        assert monitor["spec"]["selector"]["matchLabels"].items() <= service_labels.items()
        assert service_labels[monitor["spec"]["jobLabel"]] == "lossd", service_file
    deployment, container = k8s_container()
    jobs = [j["job_name"] for j in load_yaml(os.path.join(PROMETHEUS_DIR, "prometheus.yml"))["scrape_configs"]]
    assert "lossd" in jobs
    assert any(r.get("expr") == 'up{job="lossd"} == 0' for r in rules())
    (pvc,) = load_k8s("pvc.yaml")
    claims = [v["persistentVolumeClaim"]["claimName"] for v in deployment["spec"]["template"]["spec"]["volumes"]
              if "persistentVolumeClaim" in v]
    assert claims == [pvc["metadata"]["name"]]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert flag_values(container["args"])["checkpoint_dir"] in mounts
    for resource in load_yaml(os.path.join(K8S, "kustomization.yaml"))["resources"]:
        assert os.path.exists(os.path.join(K8S, resource)), resource


def test_grace_periods_exceed_drain_and_gpu_is_requested():
    default_drain = int(server_flags()["drain_seconds"])
    for name in DEPLOYMENTS:
        deployment, container = k8s_container(name)
        drain = int(flag_values(container["args"]).get("drain_seconds", default_drain))
        assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > drain, name
        assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == 1, name
        assert int(container["resources"]["requests"]["nvidia.com/gpu"]) == 1, name
        assert flag_values(container["args"])["device"].startswith("cuda"), name

    lossd = load_yaml(COMPOSE)["services"]["lossd"]
    drain = int(flag_values(lossd["command"]).get("drain_seconds", default_drain))
    grace = re.fullmatch(r"(\d+)s", lossd["stop_grace_period"])
    assert grace and int(grace.group(1)) > drain
    (device,) = lossd["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]


def test_training_replicas_meet_at_replica_zero_and_start_together():
    service, statefulset, container = replica_group()
    spec = statefulset["spec"]
    args = flag_values(container["args"])
    assert container["command"] == [docker_command()[0][0]]
    # One rank per pod, from its ordinal; as many replicas as pods.
    assert int(args["replicas"]) == spec["replicas"] >= 2
    assert args["replica_rank"] == "-1"
    # The pods find replica 0 by its stable name under the headless Service, before any of them
    # is ready (a pod is ready once the whole group has met): Parallel start, not-ready addresses
    # published.
    grpc_port = port_of(args["listen"])
    assert args["replica_store"] == \
        f"{statefulset['metadata']['name']}-0.{service['metadata']['name']}:{grpc_port}"
    assert spec["serviceName"] == service["metadata"]["name"]
    assert spec["podManagementPolicy"] == "Parallel"
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    for deployment_file in DEPLOYMENTS:
        assert not service["spec"]["selector"].items() <= pod_labels(deployment_file).items()
        (other,) = load_k8s(DEPLOYMENTS[deployment_file])
        assert not other["spec"]["selector"].items() <= labels.items(), deployment_file
    # Scraped like the others, ports as everywhere.
    (monitor,) = load_k8s("servicemonitor.yaml")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert service["metadata"]["labels"][monitor["spec"]["jobLabel"]] == "lossd"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == ports
    assert container["readinessProbe"]["grpc"]["port"] == grpc_port
    # Each pod's checkpoints on its own volume; a GPU each; drained within the grace period.
    (claim,) = spec["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == args["checkpoint_dir"]
    drain = int(args.get("drain_seconds", server_flags()["drain_seconds"]))
    assert spec["template"]["spec"]["terminationGracePeriodSeconds"] > drain
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == 1
    assert args["device"].startswith("cuda")
    # Gloo's ports are open to the group's pods alone; gRPC and metrics to all.
    (policy,) = [doc for doc in load_k8s(REPLICA_GROUP) if doc["kind"] == "NetworkPolicy"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    peers, anyone = policy["spec"]["ingress"]
    (pods,) = peers["from"]
    assert pods["podSelector"]["matchLabels"].items() <= labels.items() and "ports" not in peers
    assert "from" not in anyone
    assert {p["port"] for p in anyone["ports"]} == set(ports.values())


def test_scoring_replicas_roll_balance_and_scale():
    deployment, container = k8s_container("scoring-deployment.yaml")
    spec = deployment["spec"]
    args = flag_values(container["args"])
    # Replicas that only score: no checkpoints (a ReadWriteOnce volume is one pod's), and training
    # stays on the single-replica Deployment, which Recreates.
    assert "checkpoint_dir" not in args
    assert not [v for v in spec["template"]["spec"]["volumes"] if "persistentVolumeClaim" in v]
    (training, _) = k8s_container("deployment.yaml")
    assert training["spec"]["replicas"] == 1 and training["spec"]["strategy"]["type"] == "Recreate"
    # Rolling updates that never drop below the replicas asked for, each new pod admitted once its
    # gRPC health says SERVING.
    assert spec["strategy"]["type"] == "RollingUpdate"
    assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert spec["strategy"]["rollingUpdate"]["maxSurge"] >= 1
    assert container["readinessProbe"]["grpc"]["port"] == port_of(args["listen"])
    # Clients balance over the pods themselves: a headless Service, and connections that age out
    # so that clients reach the pods a scale-up adds.
    (service,) = load_k8s("scoring-service.yaml")
    assert service["spec"]["clusterIP"] == "None"
    assert not service["spec"].get("publishNotReadyAddresses", False)
    assert int(args["max_connection_age_seconds"]) > 0
    assert args["shared_memory"] == "false"

    (hpa,) = load_k8s("scoring-hpa.yaml")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == \
        (deployment["apiVersion"], deployment["kind"], deployment["metadata"]["name"])
    assert 2 <= hpa["spec"]["minReplicas"] <= spec["replicas"] <= hpa["spec"]["maxReplicas"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    served = {rule["name"]["as"]: rule for rule in adapter_rules()}
    assert metric["pods"]["metric"]["name"] in served, "the HPA's metric has no adapter rule"
    # The adapter maps the series' labels to the pods the HPA asks about.
    rule = served[metric["pods"]["metric"]["name"]]
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"},
                                              "pod": {"resource": "pod"}}
    # A replica that runs --max_running_calls calls and queues none is at the target.
    assert metric["pods"]["target"]["type"] == "AverageValue"
    default_running = int(server_flags()["max_running_calls"])
    assert float(metric["pods"]["target"]["averageValue"]) == \
        int(args.get("max_running_calls", default_running))
    assert {"lossd_running_calls", "lossd_queue_depth"} <= metric_names(rule["metricsQuery"])


# --- README ---------------------------------------------------------------------------------------

def operating_section():
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        text = f.read()
    start = text.index("## Operating lossd")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def test_readme_documents_flags_metrics_and_alerts(exposition):
    section = operating_section()
    rows = {line for line in section.splitlines() if line.startswith("|")}
    for flag, default in main_cc_flags().items():
        (row,) = [r for r in rows if f"`--{flag}`" in r.split("|")[1]] or [None]
        assert row, f"README: no row for --{flag}"
        if default:
            assert f"`{default}`" in row, f"README: --{flag} default should read `{default}`: {row}"
    for family in exported(exposition):
        if family.startswith("lossd_"):
            assert f"`{family}`" in section, f"README: metric {family} is not documented"
    for rule in rules():
        if "alert" in rule:
            assert rule["alert"] in section, f"README: alert {rule['alert']} is not documented"
