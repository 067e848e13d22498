"""Model networks, one file per architecture, plus shared layers (``layers``, ``moe``,
``decoder``), ``config`` (parsed ``config.json``), ``weights`` (checkpoint-name rules),
``loader`` (``load_model``) and ``registry`` (``get_architecture``). Nothing here imports from
the packages above (``dllm.runner``, ``dllm``)."""
