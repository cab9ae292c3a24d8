# The report's pages: each table, JSON or text output rendered as an HTML page beside it (report_page.py), which
# the report shows in place (it offers a CSV, JSON or TXT only as a download). Local: a page takes a moment.
# One rule per row of workflow_scripts/core/pages.py (the grid's with `grid:` only), made here. Each names its
# page and log by PAGES (rules/common.smk): the same paths, with the run as a wildcard held to the config's run, so
# that `snakemake --list-target-rules` (the rules without a wildcard) leaves them out: a page is never a target of
# its own.

from workflow_scripts.core.layout import VARIANT_PAGES  # noqa: E402
from workflow_scripts.core.pages import made  # noqa: E402

# each page's logs: the variant's where the file it renders is a variant's
PAGE_LOGS = {page.name: PAGES["VLOGS" if page.key in VARIANT_PAGES else "LOGS"] for page in made(GRID)}

# Snakemake's code trigger compares a rule's shell text: these are the commands as written before the rules were
# made from the table (a change here reruns every page). One loop each: a rule's shell expression is evaluated
# again when its job runs, after the loop, so it must not depend on the loop's page.


for page in made(GRID):
    if page.images:
        continue

    rule:
        name:
            f"render_{page.name}_page"
        input:
            globals()[page.source],
        output:
            report(
                PAGES[page.key],
                caption=f"../report/{page.caption}",
                category=page.category,
                subcategory=page.subcategory,
            ),
        log:
            f"{PAGE_LOGS[page.name]}/render_page/{page.name}.log",
        localrule: True
        conda:
            "../envs/eval.yaml"
        params:
            script=script_path("report/report_page.py"),
            title=page.title,
        shell:
            "python {params.script:q} --input {input:q} --output {output:q} --title {params.title:q} > {log} 2>&1"


# a text file with PNGs under it (the leaderboard's page)
for page in made(GRID):
    if not page.images:
        continue

    rule:
        name:
            f"render_{page.name}_page"
        input:
            text=globals()[page.source],
            plots=[globals()[name] for name in page.images],
        output:
            report(
                PAGES[page.key],
                caption=f"../report/{page.caption}",
                category=page.category,
                subcategory=page.subcategory,
            ),
        log:
            f"{PAGE_LOGS[page.name]}/render_page/{page.name}.log",
        localrule: True
        conda:
            "../envs/eval.yaml"
        params:
            script=script_path("report/report_page.py"),
            title=page.title,
        shell:
            "python {params.script:q} --input {input.text:q} --images {input.plots} --output {output:q}"
            " --title {params.title:q} > {log} 2>&1"
