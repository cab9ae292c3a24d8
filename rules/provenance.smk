rule provenance:
    input:
        manifest=MANIFEST,
        env=ENV_CHECK,
        states=expand(TRAIN_STATE, node=TRAINED, allow_missing=True),
        fetched=BASE_RECORD_INPUT,  # a hub model's fetch record: its resolved sha
    output:
        PROVENANCE,  # the report shows PROVENANCE_PAGE
    log:
        f"{VLOGS}/provenance.log",
    conda:
        "../envs/eval.yaml"
    params:
        script=script_path("report/provenance.py"),
        config=provenance_json,  # a function: data.format_template has {question}, not a wildcard
        repo=Untracked(workflow.basedir),  # the checkout (its git commit is recorded), wherever it lives
        fetched=fetch_record_args,
    shell:
        "python {params.script:q} --config {params.config:q} --repo {params.repo:q} --manifest {input.manifest}"
        " --env {input.env} --states {input.states} {params.fetched} --output {output} > {log} 2>&1"
