"""One fault grammar for both runtimes (`diloco.config.fault_grammar`): every event either runtime
takes round-trips through its text, and each runtime refuses the other's own verbs and the
old spellings with a one-line error naming its field."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.config import fault_grammar
from diloco.config.run_config import ConfigError
from diloco.distributed import chaos
from diloco.runtime import faults

RUNTIMES = {"single": faults, "multi": chaos}
SINGLE_ONLY = set(faults.RUNTIME.verbs) - set(chaos.RUNTIME.verbs)
MULTI_ONLY = set(chaos.RUNTIME.verbs) - set(faults.RUNTIME.verbs)

_times = st.floats(min_value=0.0, max_value=1e7, allow_nan=False, allow_infinity=False)


@st.composite
def events(draw, runtime: fault_grammar.Runtime) -> fault_grammar.Event:
  """Any event `runtime` takes."""
  kind = draw(st.sampled_from(runtime.verbs))
  at = draw(_times)
  if kind == "add":
    return fault_grammar.Event(at, kind)
  if kind == "kill_syncer":
    return fault_grammar.Event(at, kind, shard=draw(st.integers(0, 64)))
  ids = st.integers(0, 10_000)
  learner = draw(st.one_of(ids, st.just(fault_grammar.ANY)) if runtime.any_target else ids)
  duration = 0.0
  if kind == "stop" or (kind == "kill" and runtime.return_delay):
    duration = draw(_times.filter(lambda d: d > 0.0) if kind == "stop" else _times)
  return fault_grammar.Event(at, kind, learner, duration)


@pytest.mark.parametrize("name", sorted(RUNTIMES))
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_every_event_round_trips_through_its_text(name, data):
  module = RUNTIMES[name]
  schedule = data.draw(st.lists(events(module.RUNTIME), max_size=6))
  text = ";".join(str(e) for e in schedule)
  parsed = module.parse(text)
  assert parsed == sorted(schedule)  # text -> events gives the events back
  assert ";".join(str(e) for e in parsed) == ";".join(str(e) for e in sorted(schedule))
  for event in parsed:  # and each event's text is the text it was read from
    assert module.parse(str(event)) == [event]


def _one_line_error(parse, text: str, field: str, *words: str) -> None:
  with pytest.raises(ConfigError) as caught:
    parse(text)
  message = str(caught.value)
  assert "\n" not in message and message.startswith(f"{field}: ")
  for word in words:
    assert word in message, message


@settings(max_examples=100, deadline=None)
@given(event=events(chaos.RUNTIME))
def test_single_controller_refuses_multi_process_only_events(event):
  if event.kind in MULTI_ONLY:
    _one_line_error(faults.parse, str(event), "learners.faults", repr(event.kind),
                    ", ".join(faults.RUNTIME.verbs))
  elif event.learner == fault_grammar.ANY and event.kind != "add":
    _one_line_error(faults.parse, str(event), "learners.faults", "'*'", "learner id")
  else:
    assert faults.parse(str(event)) == [event]  # a common verb on a named learner


@settings(max_examples=100, deadline=None)
@given(event=events(faults.RUNTIME))
def test_multi_process_refuses_single_controller_only_events(event):
  if event.kind in SINGLE_ONLY:
    _one_line_error(chaos.parse, str(event), "launch.chaos", repr(event.kind),
                    ", ".join(chaos.RUNTIME.verbs))
  elif event.kind == "kill" and event.duration:
    _one_line_error(chaos.parse, str(event), "launch.chaos", "return delay",
                    f"'kill:{event.learner}@")
  else:
    assert chaos.parse(str(event)) == [event]


def test_the_verbs_are_one_set_and_each_action_has_one():
  assert SINGLE_ONLY == {"nan"} and MULTI_ONLY == {"stop", "kill_syncer"}
  assert set(faults.RUNTIME.verbs) | set(chaos.RUNTIME.verbs) == set(fault_grammar.VERBS)
  assert faults.Fault is chaos.Event is fault_grammar.Event


@pytest.mark.parametrize("module,field,new", [(faults, "learners.faults", "kill:1@30+20"),
                                              (chaos, "launch.chaos", "kill:1@30")])
def test_the_old_spelling_names_the_verb_to_write(module, field, new):
  _one_line_error(module.parse, "add@4;down:1@30+20", field, "old verb 'down'", repr(new))


def test_a_missing_return_delay():
  """Single-controller: back at once (D = 0, the same event as +0). Multi-process: the
  launcher's restart after its backoff, so its kill takes no +D."""
  assert faults.parse("kill:1@30") == faults.parse("kill:1@30+0") == [
      fault_grammar.Event(30.0, "kill", 1, 0.0)]
  assert [str(e) for e in chaos.parse("kill:*@3")] == ["kill:*@3"]


def test_help_lines_list_each_runtimes_verbs():
  assert fault_grammar.help_line(faults.RUNTIME) == (
      "kill:M@T[+D], add@T, retire:M@T or nan:M@T (M a learner id), separated by ';'")
  assert fault_grammar.help_line(chaos.RUNTIME) == (
      "kill:M@T, stop:M@T+D, kill_syncer[:S]@T, add@T or retire:M@T (M a learner id or '*', "
      "S a syncer shard), separated by ';'")
