# Only with a hub id in model.name_or_path (the Snakefile includes this file then): it downloads, so it
# runs where Snakemake runs (the login node, with internet), never on a compute node.
localrules:
    fetch_model,


rule fetch_model:
    output:
        record=FETCH_RECORD,  # every later job's base model (fingerprint.model_location)
    log:
        f"{LOGS}/fetch_model.log",
    conda:
        "../envs/data.yaml"
    params:
        script=script_path("model/fetch_model.py"),
        repo=HUB_REPO,
        revision=HUB_REVISION,
        # the commit model.revision resolved to when the workflow was parsed: a new one reruns this job and
        # everything that reads the record
        sha=HUB_SHA,
    shell:
        "python {params.script:q} --repo {params.repo:q} --revision {params.revision:q} --sha {params.sha:q}"
        " --output {output.record} > {log} 2>&1"
