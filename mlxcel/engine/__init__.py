"""The engine: generation on one device and continuous batching over any executor (docs/engine.md).

Module map:

- ``interface``     the contract between the HTTP front and whatever generates tokens (``Engine``)
- ``scheduler``     continuous batching: the thread loop, admission, prefill budget, micro-batches, results
- ``requests``      the request table: each request's record and state machine (no thread, no lock)
- ``resume``        resuming requests a node failure lost and holding new ones (``Resumer``); ``holding``,
                    ``resume_policy``: the hold's clock and the bounds
- ``outputs``, ``releases``, ``warmup``  the scheduler's emission, executor releases and warmup requests
- ``executor``      the seam between the scheduler and the compute (``ExecutorBase``, ``LocalExecutor``)
- ``runner``        one model slice for many sequences: per-sequence prefill, batched decode
- ``model_slice``   a contiguous slice of a model (embedding? + layers + norm and head?), per-family hooks
- ``flows``         what one forward pass carries layer to layer and across a stage boundary, per family
- ``generate``      single-sequence generation for ``mlxcel generate``
- ``sampling``      sampling parameters and samplers (greedy, temperature, top-p, top-k, seeds)
- ``prefix_cache``  reuse the KV of earlier prompts that share a prefix
- ``prompts``       user input -> token ids (chat template or raw)
- ``stops``, ``textstream``  stop strings and streaming detokenization
- ``emitter``       detokenization and event delivery off the scheduler thread (asynchronous scheduling)
- ``steptrace``     the opt-in per-pass timeline of the scheduler thread (``MLXCEL_STEP_TRACE``)
"""
