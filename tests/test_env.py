"""Environment switches read one way: every on/off spelling means what it says, and a value that is
neither (a typo) is an error naming the variable, the value and what is accepted."""

from __future__ import annotations

import pytest

from hipattn import checks, dispatch, env, varlen_prep
from hipattn.ops import smallseq

ON = ["1", "true", "True", "YES", "on", " On "]
OFF = ["0", "false", "FALSE", "no", "off", "Off "]


@pytest.mark.parametrize("value", ON)
def test_every_on_spelling_is_on(monkeypatch, value):
    monkeypatch.setenv("HIPATTN_TEST_SWITCH", value)
    assert env.flag("HIPATTN_TEST_SWITCH", False) is True


@pytest.mark.parametrize("value", OFF)
def test_every_off_spelling_is_off(monkeypatch, value):
    monkeypatch.setenv("HIPATTN_TEST_SWITCH", value)
    assert env.flag("HIPATTN_TEST_SWITCH", True) is False


@pytest.mark.parametrize("value", [None, "", "  "])
def test_unset_or_empty_is_the_default(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("HIPATTN_TEST_SWITCH", raising=False)
    else:
        monkeypatch.setenv("HIPATTN_TEST_SWITCH", value)
    assert env.flag("HIPATTN_TEST_SWITCH", True) is True
    assert env.flag("HIPATTN_TEST_SWITCH", False) is False
    assert env.choice("HIPATTN_TEST_SWITCH", ("a", "b"), "b") == "b"


@pytest.mark.parametrize("value", OFF)
def test_hipattn_check_false_or_off_leaves_the_check_off(monkeypatch, value):
    monkeypatch.setenv(checks.SWITCH, value)
    assert not checks.enabled()


@pytest.mark.parametrize("value", OFF)
def test_hipattn_smallseq_false_or_off_turns_the_path_off(monkeypatch, value):
    monkeypatch.setenv("HIPATTN_SMALLSEQ", value)
    assert not dispatch.smallseq_enabled()


@pytest.mark.parametrize(
    ("variable", "value", "read"),
    [
        ("HIPATTN_CHECK", "maybe", checks.enabled),
        ("HIPATTN_CHECK", "2", checks.enabled),
        ("HIPATTN_SMALLSEQ", "disable", dispatch.smallseq_enabled),
        ("HIPATTN_SMALLSEQ_KERNEL", "portabel", smallseq._portable_forced),
        ("HIPATTN_VARLEN_PREP", "gpu", varlen_prep.prep_way),
    ],
)
def test_a_typo_in_a_switch_is_an_error_naming_variable_value_and_choices(monkeypatch, variable, value, read):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError) as raised:
        read()
    message = str(raised.value)
    assert f"{variable}={value!r}" in message and "expected" in message


def test_choices_are_named_in_the_error(monkeypatch):
    monkeypatch.setenv("HIPATTN_SMALLSEQ_KERNEL", "portabel")
    with pytest.raises(ValueError, match="HIPATTN_SMALLSEQ_KERNEL='portabel'; expected one of auto, portable"):
        smallseq._portable_forced()
    monkeypatch.setenv("HIPATTN_CHECK", "maybe")
    with pytest.raises(ValueError, match="expected 1/0, true/false, yes/no or on/off"):
        checks.enabled()


def test_varlen_prep_reads_its_switch_through_the_shared_helper(monkeypatch):
    seen = []
    real = env.choice

    def spy(name, choices, default):
        seen.append((name, tuple(choices), default))
        return real(name, choices, default)

    monkeypatch.setattr(env, "choice", spy)
    monkeypatch.setenv("HIPATTN_VARLEN_PREP", "Host")
    assert varlen_prep.prep_way() == "host"
    assert seen == [("HIPATTN_VARLEN_PREP", ("device", "host"), "device")]
