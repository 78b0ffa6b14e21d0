"""lossd.options: the Python objects of a call's options and outputs are lossd.proto's, derived
from its descriptors, so that what the proto adds the client has without another copy."""
import random

import pytest

from server_process import ensure_python_client

ensure_python_client()
import lossd  # noqa: E402
from lossd import options  # noqa: E402
from lossd.client import LossResult  # noqa: E402
from lossd.v1 import lossd_pb2 as pb  # noqa: E402

CLASSES = [(lossd.LossOptions, pb.LossOptions), (lossd.PolicyOptions, pb.PolicyOptions),
           (lossd.DistillOptions, pb.DistillOptions)]


@pytest.mark.parametrize("cls, message", CLASSES)
def test_every_field_of_the_proto_is_an_option_of_the_same_name(cls, message):
    assert [f.name for f in cls.__dataclass_fields__.values()] == \
        [f.name for f in message.DESCRIPTOR.fields]


def random_options(rng):
    """Options with every field set to something other than its default."""
    def value(field):
        if field.enum_type is not None:
            return rng.choice(list(options.enum_choices(field.enum_type))[1:])
        if field.cpp_type in (field.CPPTYPE_FLOAT, field.CPPTYPE_DOUBLE):
            return rng.uniform(0.01, 2.0)
        if field.cpp_type == field.CPPTYPE_BOOL:
            return True
        return rng.randrange(1, 1000)

    def build(cls, message):
        fields = {}
        for field in message.DESCRIPTOR.fields:
            if field.message_type is not None:
                nested = {"PolicyOptions": (lossd.PolicyOptions, pb.PolicyOptions),
                          "DistillOptions": (lossd.DistillOptions, pb.DistillOptions)}
                fields[field.name] = build(*nested[field.message_type.name])
            else:
                fields[field.name] = value(field)
        return cls(**fields)

    return build(lossd.LossOptions, pb.LossOptions)


def test_options_go_to_the_proto_and_back_unchanged():
    rng = random.Random()
    for _ in range(20):
        chosen = random_options(rng)
        proto = chosen.to_proto()
        assert lossd.LossOptions.from_proto(proto) == chosen
        assert pb.LossOptions.FromString(proto.SerializeToString()) == proto


def test_unset_options_leave_the_servers_defaults_and_set_ones_are_sent():
    proto = lossd.LossOptions().to_proto()
    for name in ("ignore_index", "temperature", "grad_scale", "logit_softcap"):
        assert not proto.HasField(name), name  # the server's -100, 1, 1 and the head's cap
    assert not proto.policy.HasField("clip_low")
    proto = lossd.LossOptions(ignore_index=-1, logit_softcap=0.0).to_proto()
    assert proto.ignore_index == -1 and proto.HasField("logit_softcap")  # 0 turns the cap off


def test_enum_fields_take_their_lower_case_names_and_verls_reductions():
    assert options.REDUCTIONS["seq-mean-token-mean"] == pb.REDUCTION_SEQUENCE_MEAN_TOKEN_MEAN
    assert options.OBJECTIVES == {"cross_entropy": 0, "importance_sampling": 1, "ppo": 2,
                                  "cispo": 3, "logprob_gradient": 4, "distill": 5, "dro": 6,
                                  "sapo": 7, "gspo": 8}
    assert lossd.LossOptions(reduction="token-mean").to_proto().reduction == pb.REDUCTION_MEAN
    with pytest.raises(ValueError, match="objective: expected one of cross_entropy"):
        lossd.LossOptions(objective="dpo").to_proto()


def test_keywords_name_fields_of_the_options_and_their_parts():
    built = options.options_from_keywords(reduction="sum", clip_high=0.28, kl_estimator="k3",
                                          distill_beta=0.5, teacher_temperature=2.0)
    assert built.reduction == "sum"
    assert (built.policy.clip_high, built.policy.kl_estimator) == (0.28, "k3")
    assert (built.distill.beta, built.distill.teacher_temperature) == (0.5, 2.0)
    base = lossd.LossOptions(objective="ppo")
    assert options.options_from_keywords(base, entropy_coef=0.01).objective == "ppo"
    with pytest.raises(TypeError, match="unexpected keyword 'clip'.*clip_high"):
        options.options_from_keywords(clip=0.2)


def test_the_outputs_are_the_proto_fields_the_selection_names():
    """Each repeated field of ComputeResult is a per-row output named by OutputSelection, or a
    top_k_* field: none is left unreachable, none is named that the results cannot carry."""
    result_fields = {f.name for f in pb.ComputeResult.DESCRIPTOR.fields
                     if options._is_repeated(f)}
    assert result_fields == set(options.ROW_OUTPUT_NAMES) | set(options.TOP_K_OUTPUT_NAMES)
    selection = {f.name for f in pb.OutputSelection.DESCRIPTOR.fields}
    assert set(options.ROW_OUTPUT_NAMES) <= selection
    assert "grad_hidden" in options.OUTPUT_NAMES


def test_a_result_answers_every_summary_field_and_every_output_by_name():
    summary = pb.ComputeSummary(loss=1.5, counted_tokens=4, correct_tokens=1, mean_kd=0.25)
    result = LossResult(summary, {"kd": [0.0, 1.0]})
    for field in pb.ComputeSummary.DESCRIPTOR.fields:
        assert getattr(result, field.name) == getattr(summary, field.name)
    assert result.kd == [0.0, 1.0] and result.logprob is None and result.accuracy == 0.25
    with pytest.raises(AttributeError):
        result.no_such_field  # noqa: B018
