"""A Compute call's options and outputs as Python objects, derived from the wire contract.

lossd.proto is the one description of what a call can ask for: the classes here are made from its
messages when the package is imported, so that an option or per-token output added there is
here too, under the same name, without another copy to keep in step.

    options = lossd.LossOptions(reduction="sum", objective="ppo",
                                policy=lossd.PolicyOptions(clip_high=0.28, kl_estimator="k3"))
    client.compute("main", hidden, labels, options=options, advantages=a, sampling_logprobs=q)
    client.compute("main", hidden, labels, reduction="sum", objective="ppo", clip_high=0.28)

LossOptions, PolicyOptions and DistillOptions mirror lossd.v1's messages field by field (see
lossd.proto for what each means and its range). Enum fields take lower-case names: the enum
value's name without its prefix ("mean", "seq-mean-token-sum" too for verl's names, "ppo",
"k3", "spread"). A field the proto marks optional is None by default, which leaves it unset, so
the server's default applies (ignore_index -100, temperature 1, grad_scale 1, clip_low and
clip_high 0.2, the head's soft cap); any other field has the proto's zero default.

Keyword arguments name fields directly, flattened: a keyword is a field of LossOptions, else of
PolicyOptions, else of DistillOptions (distill_beta, distill_alpha and distill_temperature name
DistillOptions' beta, alpha and temperature).

Per-token outputs (OutputSelection): each bool field of lossd.v1.OutputSelection that names a
repeated field of lossd.v1.ComputeResult is an output of one value per row; top_k > 0 adds the
top_k_* fields, top_k values per row; grad_hidden is dL/dh.
"""
import dataclasses
import os
from typing import Optional

from google.protobuf.descriptor import FieldDescriptor

from lossd.v1 import lossd_pb2 as pb

_MESSAGE_CPP_TYPE = FieldDescriptor.CPPTYPE_MESSAGE
_ENUM_CPP_TYPE = FieldDescriptor.CPPTYPE_ENUM
# Python types of the fields (an enum's is its value's name).
_CPP_TYPES = {FieldDescriptor.CPPTYPE_INT32: int, FieldDescriptor.CPPTYPE_INT64: int,
              FieldDescriptor.CPPTYPE_UINT32: int, FieldDescriptor.CPPTYPE_UINT64: int,
              FieldDescriptor.CPPTYPE_DOUBLE: float, FieldDescriptor.CPPTYPE_FLOAT: float,
              FieldDescriptor.CPPTYPE_BOOL: bool, FieldDescriptor.CPPTYPE_ENUM: str,
              FieldDescriptor.CPPTYPE_STRING: str}


def _enum_prefix(enum_descriptor):
    """The prefix every value of an enum shares up to an underscore ("REDUCTION_")."""
    names = [value.name for value in enum_descriptor.values]
    prefix = os.path.commonprefix(names)
    return prefix[:prefix.rfind("_") + 1]


def enum_choices(enum_descriptor):
    """{lower-case name without the prefix: number} of an enum's values."""
    prefix = _enum_prefix(enum_descriptor)
    return {value.name[len(prefix):].lower(): value.number for value in enum_descriptor.values}


# Names lossd takes beside the enums' own: verl's agg_loss modes.
_ALIASES = {
    "Reduction": {"token-mean": pb.REDUCTION_MEAN,
                  "seq-mean-token-sum": pb.REDUCTION_SEQUENCE_MEAN_TOKEN_SUM,
                  "seq-mean-token-mean": pb.REDUCTION_SEQUENCE_MEAN_TOKEN_MEAN},
}


def _choices(enum_descriptor):
    return {**enum_choices(enum_descriptor), **_ALIASES.get(enum_descriptor.name, {})}


REDUCTIONS = _choices(pb.Reduction.DESCRIPTOR)
OBJECTIVES = _choices(pb.Objective.DESCRIPTOR)
KL_ESTIMATORS = _choices(pb.KlEstimator.DESCRIPTOR)
SPARSE_TEACHER_MASSES = _choices(pb.SparseTeacherMass.DESCRIPTOR)


def _enum_name(enum_descriptor, number):
    """The lower-case name of an enum's number (its own, not an alias)."""
    for name, value in enum_choices(enum_descriptor).items():
        if value == number:
            return name
    return number


def _has_presence(field):
    return field.has_presence and field.containing_oneof is not None


def _default(field, classes):
    if field.cpp_type == _MESSAGE_CPP_TYPE:
        return dataclasses.field(default_factory=classes[field.message_type.name])
    if _has_presence(field):
        return None
    if field.cpp_type == _ENUM_CPP_TYPE:
        return _enum_name(field.enum_type, field.default_value)
    return field.default_value


def _to_proto(options, message_class):
    """The lossd.v1 message of an options object: fields left None stay unset."""
    message = message_class()
    for field in message_class.DESCRIPTOR.fields:
        value = getattr(options, field.name)
        if value is None:
            continue
        if field.cpp_type == _MESSAGE_CPP_TYPE:
            getattr(message, field.name).CopyFrom(value.to_proto())
            continue
        if field.cpp_type == _ENUM_CPP_TYPE:
            choices = _choices(field.enum_type)
            if value not in choices:
                raise ValueError(f"{field.name}: expected one of {', '.join(map(str, choices))}, "
                                 f"got {value!r}")
            value = choices[value]
        setattr(message, field.name, value)
    return message


def _from_proto(cls, message):
    values = {}
    for field in message.DESCRIPTOR.fields:
        if _has_presence(field) and not message.HasField(field.name):
            values[field.name] = None
        elif field.cpp_type == _MESSAGE_CPP_TYPE:
            values[field.name] = _CLASSES[field.message_type.name].from_proto(
                getattr(message, field.name))
        elif field.cpp_type == _ENUM_CPP_TYPE:
            values[field.name] = _enum_name(field.enum_type, getattr(message, field.name))
        else:
            values[field.name] = getattr(message, field.name)
    return cls(**values)


def _options_class(message_class, classes):
    """A frozen dataclass with a field per field of `message_class`, in the proto's order."""
    fields = []
    for field in message_class.DESCRIPTOR.fields:
        if field.cpp_type == _MESSAGE_CPP_TYPE:
            annotation = classes[field.message_type.name]
        else:
            annotation = Optional[_CPP_TYPES.get(field.cpp_type, object)]
        fields.append((field.name, annotation, _default(field, classes)))
    namespace = {
        "to_proto": lambda self: _to_proto(self, message_class),
        "from_proto": classmethod(lambda cls, message: _from_proto(cls, message)),
        "replace": lambda self, **changes: dataclasses.replace(self, **changes),
        "__doc__": f"lossd.v1.{message_class.DESCRIPTOR.name} as a Python object (see the module "
                   f"docstring and lossd.proto).",
    }
    cls = dataclasses.make_dataclass(message_class.DESCRIPTOR.name, fields, frozen=True,
                                     namespace=namespace)
    cls.__module__ = __name__
    return cls


_CLASSES = {}
for _message in (pb.PolicyOptions, pb.DistillOptions, pb.LossOptions):  # nested ones first
    _CLASSES[_message.DESCRIPTOR.name] = _options_class(_message, _CLASSES)
PolicyOptions = _CLASSES["PolicyOptions"]
DistillOptions = _CLASSES["DistillOptions"]
LossOptions = _CLASSES["LossOptions"]

# DistillOptions' fields whose names LossOptions already has, as keywords.
_DISTILL_PREFIXED = {"distill_" + name: name for name in ("beta", "alpha", "temperature")}


def _field_names(cls):
    return {field.name for field in dataclasses.fields(cls)}


def options_from_keywords(options=None, **keywords):
    """`options` (a LossOptions, default LossOptions()) with the keywords set on it, each the
    name of a field of LossOptions, PolicyOptions or DistillOptions (see the module docstring).
    A keyword that names none of them is a TypeError that lists those it could have been."""
    options = LossOptions() if options is None else options
    if not isinstance(options, LossOptions):
        raise TypeError(f"options: expected a lossd.LossOptions, got {type(options).__name__}")
    top, policy, distill = {}, {}, {}
    loss_fields = _field_names(LossOptions) - {"policy", "distill"}
    for name, value in keywords.items():
        if name in loss_fields:
            top[name] = value
        elif name in _field_names(PolicyOptions):
            policy[name] = value
        elif name in _field_names(DistillOptions):
            distill[name] = value
        elif name in _DISTILL_PREFIXED:
            distill[_DISTILL_PREFIXED[name]] = value
        else:
            known = sorted(loss_fields | _field_names(PolicyOptions) |
                           _field_names(DistillOptions) | set(_DISTILL_PREFIXED))
            raise TypeError(f"unexpected keyword {name!r}: not an option of lossd.proto's "
                            f"LossOptions, PolicyOptions or DistillOptions ({', '.join(known)})")
    if policy:
        top["policy"] = options.policy.replace(**policy)
    if distill:
        top["distill"] = options.distill.replace(**distill)
    return options.replace(**top) if top else options


# The loss aggregations of GRPO's variants by the names Liger-Kernel's LigerFusedLinearGRPOLoss
# (chunked_loss/grpo_loss.py, loss_type) and TRL's GRPOTrainer give them, and verl's constant
# normalizer, each as a reduction and the mean's denominator over a [B, T] batch of B sequences.
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "seq-mean-token-sum-norm")


def grpo_loss_type(loss_type, *, num_sequences=None, max_completion_length=None,
                   global_tokens=None):
    """The option keywords (reduction, mean_denominator) of a GRPO variant's aggregation:

      grpo      each sequence's mean token loss, summed over the batch's num_sequences sequences
                and divided by that count (a sequence with no kept token counts too)
      bnpo      the kept tokens' mean (lossd's "mean")
      dr_grpo   the kept tokens' sum / (num_sequences * max_completion_length), Dr. GRPO's
                constant normalizer
      dapo      the kept tokens' sum / global_tokens, the kept tokens of the whole global batch
                (over every process); without it, of this call
      seq-mean-token-sum-norm   verl's: the kept tokens' sum / max_completion_length

    Give the sequences to the call as sequence_lengths (a [B, T] batch: [T] * B)."""
    def needs(value, name):
        if value is None or not value > 0:
            raise ValueError(f"{name}: loss_type {loss_type!r} needs a count > 0, got {value!r}")
        return float(value)

    if loss_type == "grpo":
        return dict(reduction="sequence_mean_token_mean",
                    mean_denominator=needs(num_sequences, "num_sequences"))
    if loss_type == "bnpo":
        return dict(reduction="mean")
    if loss_type == "dr_grpo":
        return dict(reduction="mean",
                    mean_denominator=needs(num_sequences, "num_sequences") *
                    needs(max_completion_length, "max_completion_length"))
    if loss_type == "dapo":
        if global_tokens is None:
            return dict(reduction="mean")
        return dict(reduction="mean", mean_denominator=needs(global_tokens, "global_tokens"))
    if loss_type == "seq-mean-token-sum-norm":
        return dict(reduction="mean",
                    mean_denominator=needs(max_completion_length, "max_completion_length"))
    raise ValueError(f"loss_type: expected one of {', '.join(GRPO_LOSS_TYPES)}, got {loss_type!r}")


def option_keyword_names():
    """Every keyword options_from_keywords takes."""
    return (_field_names(LossOptions) - {"policy", "distill"}) | _field_names(PolicyOptions) | \
        _field_names(DistillOptions) | set(_DISTILL_PREFIXED)


def _is_repeated(field):
    # protobuf 5 and later name it; older ones only have the label.
    if hasattr(field, "is_repeated"):
        return field.is_repeated
    return field.label == FieldDescriptor.LABEL_REPEATED


# Per-token outputs, by the proto's naming rule (module docstring).
_RESULT_FIELDS = {field.name: field for field in pb.ComputeResult.DESCRIPTOR.fields
                  if _is_repeated(field)}
ROW_OUTPUT_NAMES = tuple(field.name for field in pb.OutputSelection.DESCRIPTOR.fields
                         if field.cpp_type == FieldDescriptor.CPPTYPE_BOOL and
                         field.name in _RESULT_FIELDS)
TOP_K_OUTPUT_NAMES = tuple(name for name in _RESULT_FIELDS if name.startswith("top_k_"))
# What compute(outputs=...) takes: the per-row outputs and dL/dh.
OUTPUT_NAMES = ROW_OUTPUT_NAMES + ("grad_hidden",)


def output_numpy_dtype(name):
    """The numpy dtype of a per-token output: its ComputeResult field's type (enums: int32)."""
    import numpy as np

    field = _RESULT_FIELDS[name]
    floating = field.cpp_type in (FieldDescriptor.CPPTYPE_FLOAT, FieldDescriptor.CPPTYPE_DOUBLE)
    return np.float32 if floating else np.int32
