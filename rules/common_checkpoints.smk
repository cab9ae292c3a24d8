# The helpers of rules/checkpoint_eval.smk (and of consolidate_node's consolidate.select, provenance's config).
# eval.checkpoints all or every_n: each kept checkpoint of each trained model consolidated (export/consolidate.py,
# --checkpoint) and scored (evals/evaluation.py, as evaluate_model) as its own jobs, then eval/checkpoints.csv and
# its curves (evals/checkpoint_scores.py). Which checkpoints exist is known once training has run: with
# eval.checkpoints all or every_n, train_node and train_joint are Snakemake checkpoints, and checkpoint_results()
# lists the complete step-<N> folders of the node's run key then. A checkpoint's result is named by its run key
# and step, so a new checkpoint adds its two jobs and one scored before is never scored again (its consolidated
# model is temp(): gone once scored).
# consolidate.select best:<metric>: consolidate_node waits for the scores and exports the best checkpoint.
# With eval.checkpoints last (the default) none of these rules exist.

from workflow_scripts.evals.checkpoint_select import kept_steps, select_metric, steps_to_score  # noqa: E402

CHECKPOINTS_MODE = EVAL["checkpoints"]
SCORE_CHECKPOINTS = CHECKPOINTS_MODE != "last"
try:
    SELECT_METRIC = select_metric(config["consolidate"]["select"], EVAL["tasks"], CHECKPOINTS_MODE)
except UserError as e:
    fail(e)
# the per-checkpoint models are the plain consolidation of their step (no selection among them)
CHECKPOINT_CONSOLIDATE_CONFIG = verbatim(ConsolidateConfig.to_json(config, without=("consolidate.select",)))


def as_before_checkpoints(resolved):
    """provenance.json's config without eval.checkpoints, eval.checkpoint_every and consolidate.select while
    they are the defaults: a finished run's provenance as before they existed."""
    defaults = {"eval": ("checkpoints", "last"), "consolidate": ("select", "last")}
    for section, (key, default) in defaults.items():
        if resolved[section][key] == default:
            drop = {key, "checkpoint_every"} if section == "eval" else {key}
            resolved = resolved | {section: {k: v for k, v in resolved[section].items() if k not in drop}}
    return resolved


def as_snakemake_checkpoints(names):
    """Make the training rules Snakemake checkpoints, as the `checkpoint` keyword does (Workflow.rule sets the flag
    and registers the rule): Snakemake re-plans after their jobs, once the step folders they leave are there."""
    for name in names:
        made = workflow.get_rule(name)
        made.is_checkpoint = True
        checkpoints.register(made)


def trained_state(node, wildcards):
    """The trained model's train_state.json once its training has run (a Snakemake checkpoint: until then the
    jobs that need it wait, and Snakemake re-plans after it)."""
    if JOINT:
        return checkpoints.train_joint.get(**variant_of(wildcards)).output.state
    return checkpoints.train_node.get(node=node, **variant_of(wildcards)).output.state


def checkpoint_results(wildcards, nodes=None):
    """The results of the kept checkpoints eval.checkpoints scores (checkpoint_select.steps_to_score), of every
    trained model (or of ``nodes``): eval/checkpoints/<model>/<run key>/step-<N>.json."""
    files = []
    for node in nodes or TRAINED:
        root = Path(json.loads(Path(trained_state(node, wildcards)).read_text())["plan"]["checkpoints"])
        for step in steps_to_score(kept_steps(root), CHECKPOINTS_MODE, EVAL["checkpoint_every"]):
            files.append(CHECKPOINT_EVAL.format(node=node, key=root.name, step=step, **variant_of(wildcards)))
    return files


def selection_input(wildcards):
    """consolidate.select best: consolidate_node's named input `scored`, the node's scored checkpoints (the script
    reads them by the layout): none with select last, so the job's inputs and command stay as before."""
    return {"scored": checkpoint_results(wildcards, [wildcards.node])} if SELECT_METRIC else {}


def checkpoint_folder(wildcards):
    """The checkpoint consolidate_checkpoint reads: <checkpoints>/<run key>/step-<N> (a params function)."""
    return str(
        Path(CHECKPOINTS.format(node=wildcards.node, **variant_of(wildcards)))
        / wildcards.key
        / f"step-{wildcards.step}"
    )


def checkpoint_marker(wildcards):
    """Its COMPLETE marker, consolidate_checkpoint's input: a checkpoint written again is consolidated again."""
    return f"{checkpoint_folder(wildcards)}/COMPLETE"


def node_state(wildcards):
    """The node's train_state.json as a param (the base model, strategy and LoRA settings its checkpoints have):
    not an input, so that a newer train_state.json (training rerun for its outputs) does not rescore them."""
    return TRAIN_STATE.format(node=wildcards.node, **variant_of(wildcards))


def scores_root(wildcards):
    """eval/checkpoints of the job's variant: checkpoint_scores reads every result scored under its run keys."""
    return str(Path(CHECKPOINT_EVAL.format(node="x", **variant_of(wildcards))).parent.parent.parent)


def hold_for_scoring():
    """Tell the trainers which checkpoints to keep from pruning until scored (train/checkpoint.py's HOLD_FILE,
    beside each node's run keys): written with eval.checkpoints all or every_n, removed with last. Called
    onstart (common.smk), before any job runs: a dry run or a report writes nothing."""
    from workflow_scripts.train.checkpoint import HOLD_FILE

    for values in [{"variant": v} for v in VARIANTS] or [{}]:
        for node in TRAINED:
            hold = Path(CHECKPOINTS.format(node=node, **values)) / HOLD_FILE
            if not SCORE_CHECKPOINTS:
                hold.unlink(missing_ok=True)
                continue
            scores = Path(CHECKPOINT_EVAL.format(node=node, **values)).parent.parent
            wanted = {"mode": CHECKPOINTS_MODE, "every": EVAL["checkpoint_every"], "scores": str(scores)}
            if not hold.exists() or json.loads(hold.read_text()) != wanted:
                hold.parent.mkdir(parents=True, exist_ok=True)
                hold.write_text(json.dumps(wanted, sort_keys=True) + "\n")
