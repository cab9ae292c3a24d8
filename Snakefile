"""From raw instruction data to evaluated fine-tuned models; see README.md."""

import sys

# The scripts are the package workflow_scripts of this checkout, wherever it lives: importable by the rules'
# helpers here, and by every job's python (rules run the scripts by path) through PYTHONPATH.
sys.path.insert(0, workflow.basedir)
from workflow_scripts.core.pipeline_io import checkout_on_pythonpath

checkout_on_pythonpath()


include: "rules/config_files.smk"


# The demo's config, unless a --configfile is given: a user's file replaces it, so a key it leaves out takes
# the schema's default (config/schema.yaml), never the demo's (its eval.tasks, its data).
if not workflow.overwrite_configfiles:
    check_config_files(["config/config.yaml"])  # empty, or a key twice: one line naming it

    configfile: "config/config.yaml"


report: "report/workflow.rst"


include: "rules/common.smk"
include: "rules/common_checkpoints.smk"
include: "rules/handlers.smk"
include: "rules/environment.smk"
include: "rules/split.smk"
include: "rules/decontaminate.smk"
include: "rules/model.smk"
include: "rules/tokenization.smk"
include: "rules/data_report.smk"
include: "rules/preflight.smk"
include: "rules/reference_logps.smk"
include: "rules/train.smk"
include: "rules/checkpoint_eval.smk"
include: "rules/consolidate.smk"
include: "rules/evaluation.smk"
include: "rules/soup.smk"
include: "rules/summarize.smk"
include: "rules/provenance.smk"
include: "rules/report_pages.smk"
include: "rules/publish.smk"


if HUB_REPO:

    include: "rules/fetch_model.smk"


if GRID:

    include: "rules/grid.smk"


rule all:
    default_target: True
    input:
        final_outputs(),


remember_signatures()  # every rule is defined: their functions' signatures, read once
