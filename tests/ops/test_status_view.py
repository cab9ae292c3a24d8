"""status_view.py and the --watch frames: the phases in one vocabulary, the redraw without a blank frame."""


def test_phases_in_one_vocabulary():
    from workflow_scripts.ops.status import NodeStatus
    from workflow_scripts.ops.status_view import PHASES, phase, state_word

    def node(state, model=False, eval_loss=None):
        return NodeStatus(variant="", node="node0", state=state, model=model, eval_loss=eval_loss)

    cases = [(node("waiting"), set(), "queued"), (node("pending"), set(), "queued"),
             (node("starting"), set(), "training"), (node("stalled"), set(), "training"),
             (node("running"), set(), "training"), (node("done"), {"consolidate node0"}, "consolidating"),
             (node("done", True), {"evaluate node0"}, "evaluating"), (node("done", True, 1.5), set(), "done"),
             (node("done", True), set(), "queued"), (node("timeout"), set(), "failed"),
             (node("stopped"), set(), "failed")]  # fmt: skip
    for s, running, expected in cases:
        assert phase(s, running) == expected in PHASES, (s.state, running)
    assert state_word(node("stalled")) == "training (stalled)" and state_word(node("running")) == "training"
    assert state_word(node("done", True)) == "queued (evaluation next)"


def test_watch_redraws_in_place_without_a_blank_frame():
    from rich.console import Console

    from workflow_scripts.ops.status import CLEAR_BELOW, CLEAR_LINE, CLEAR_SCREEN, HOME, frame, redraw

    first, later = frame("a\nbb\n", True), frame("a\nbb", False)
    assert first.startswith(CLEAR_SCREEN + HOME) and CLEAR_SCREEN not in later  # the screen cleared once only
    assert later == HOME + "a" + CLEAR_LINE + "\n" + "bb" + CLEAR_LINE + "\n" + CLEAR_BELOW
    import io

    out = io.StringIO()
    console = Console(file=out, width=80, color_system=None)
    assert redraw(console, lambda: console.print("run r: evaluating") or True, False) is True
    assert out.getvalue() == HOME + "run r: evaluating" + CLEAR_LINE + "\n" + CLEAR_BELOW
