"""core: what every stage shares and nothing stage-specific: file I/O and one-line errors (pipeline_io), the typed
and schema-checked stage configs (settings), where every output lives (layout), the parquet contracts between
stages (contracts), fingerprints of data and models (fingerprint, hub_model), a grid's variants (variants), host
memory, plotting. Imports nothing else of workflow_scripts.
"""
