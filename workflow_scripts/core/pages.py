"""The report's pages, one row each: which output each renders as HTML (report_page.py), where, and how the report
shows it.

Adding a page is one row here, its caption (report/<caption>) and, where its input needs it, its content code in
report_page.py: rules/report_pages.smk makes each row's render_<name>_page rule, rules/common.smk's final_outputs()
asks for every page, and layout.py lists each page's path (status.py reads them by it) beside the file it
renders: a page of a variant's file (layout.VARIANT_FILES) is a variant's, in the variant's folder and logs, and a
page of a shared file (layout.RUN_FILES) is the run's.
"""

from typing import NamedTuple


class Page(NamedTuple):
    name: str  # the rule render_<name>_page, its log render_page/<name>.log
    key: str  # the page's path's name in layout.py (PAGES[key] in the rules)
    path: str  # the page, under the folder of the file it renders
    source: str  # the layout name of the file it renders (its input)
    title: str  # the page's heading
    caption: str  # its caption in the report, a file under report/
    category: str  # its category in the report
    subcategory: str | None = None
    images: tuple[str, ...] = ()  # layout names of PNGs shown under the text of `source` (a text file)
    grid_only: bool = False  # made with `grid:` only (its source is too)


# In the order final_outputs() asks for them (the order of `all`'s inputs).
PAGES = (
    Page(
        "grid", "GRID_PAGE", "eval/grid.html", "GRID_TABLE",
        "eval/grid.csv: every variant's models against base", "grid.rst", "Grid", grid_only=True,
    ),
    Page(
        "environment", "ENV_PAGE", "env/check.html", "ENV_CHECK",
        "env/check.json: software, hardware and a quick benchmark", "environment.rst", "Environment",
    ),
    Page("data", "DATA_PAGE", "data/data_report.html", "DATA_REPORT", "data/report.json: what the data stages did",
         "data.rst", "Data"),
    Page("plan", "PLAN_PAGE", "plan/memory.html", "PLAN_TABLE",
         "plan/memory.csv: memory per GPU and host RAM, planned", "plan.rst", "Plan"),
    Page(
        "summary", "SUMMARY_PAGE", "eval/summary.html", "SUMMARY",
        "eval/summary.csv: every model on the held-out set, with 95% intervals", "summary.rst",
        "Evaluation", "1. Best model",
    ),
    # the report's first page shows this page's body (report/workflow.rst)
    Page(
        "leaderboard", "LEADERBOARD_PAGE", "eval/leaderboard.html", "LEADERBOARD_TEXT",
        "The best model per metric (eval/leaderboard.txt) and the key plots", "leaderboard_text.rst",
        "Evaluation", "1. Best model", images=("LEADERBOARD", "LOSS_CURVES", "TASKS_PLOT"),
    ),
    Page("tasks", "TASKS_PAGE", "eval/tasks.html", "TASKS", "eval/tasks.csv: every model x task x metric",
         "tasks_table.rst", "Evaluation", "2. Per task"),
    Page("samples", "SAMPLES_PAGE", "eval/samples.html", "SAMPLES",
         "eval/samples.csv: held-out prompts, references and answers", "samples.rst", "Evaluation"),
    Page("consolidation", "CONSOLIDATION_PAGE", "eval/consolidation.html", "CONSOLIDATION",
         "eval/consolidation.csv: each trained model's consolidation", "consolidation.rst", "Training"),
    Page("provenance", "PROVENANCE_PAGE", "provenance.html", "PROVENANCE",
         "provenance.json: what produced these models", "provenance.rst", "Provenance"),
)  # fmt: skip


def made(grid: bool) -> list[Page]:
    """The pages a run makes: the grid's only with `grid:`."""
    return [page for page in PAGES if grid or not page.grid_only]
