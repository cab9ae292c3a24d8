"""The config files as written, checked before Snakemake's reading of them is used: an empty file, one without keys
at its top level, a key given twice (Snakemake keeps the last silently) stop with one line naming the file
(settings.check_config_file). A --configfile is loaded by Snakemake before any of the workflow's code runs, so an
empty one stops there, with Snakemake's own message (README, "Troubleshooting"); the Snakefile's default
config/config.yaml is checked before its `configfile:` loads it."""

from workflow_scripts.core.pipeline_io import UserError  # noqa: E402
from workflow_scripts.core.settings import check_config_file  # noqa: E402


def check_config_files(paths):
    """Each config file: one line naming it and exit 1 when settings.check_config_file refuses it."""
    for path in dict.fromkeys(map(str, paths)):
        try:
            check_config_file(path)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(1)


check_config_files(workflow.configfiles)  # the --configfile files, loaded already
