"""The parts of one conversion run, which :func:`convert.job.convert` hands each run to.

- :mod:`~convert.run.source`: the input resolved to a local path (:class:`~convert.run.source.ResolvedSource`);
- :mod:`~convert.run.result`: what a run did (:class:`~convert.run.result.ConvertResult`, ``--json``);
- :mod:`~convert.run.single`: one target's run once its source is resolved: the options checked, the plan, the
  LoRA merge, the target's job, the output claimed, written, verified and committed;
- :mod:`~convert.run.adapter`: a PEFT LoRA adapter as SRC, written as its GGUF LoRA adapter;
- :mod:`~convert.run.several`: a run of several targets (``--to bf16,gguf:q8_0,nf4``) from one read, each target
  as its single run.

Imports go one way: several -> single, adapter -> single -> source, result.
"""
