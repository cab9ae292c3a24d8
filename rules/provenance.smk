rule provenance:
    input:
        manifest=MANIFEST,
        env=ENV_CHECK,
        states=expand(TRAIN_STATE, node=TRAINED),
    output:
        report(PROVENANCE, caption="../report/provenance.rst", category="Provenance"),
    log:
        f"{LOGS}/provenance.log",
    conda:
        "../envs/eval.yaml"
    params:
        script=script_path("provenance.py"),
        config=verbatim(json.dumps(config, sort_keys=True)),  # data.format_template has {question}
        repo=workflow.basedir,
    shell:
        "python {params.script} --config {params.config:q} --repo {params.repo} --manifest {input.manifest}"
        " --env {input.env} --states {input.states} --output {output} > {log} 2>&1"
