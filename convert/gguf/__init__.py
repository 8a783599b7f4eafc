"""``--to gguf[:TYPE]``: GGUF files for llama.cpp and Ollama, as llama.cpp's converter and
``llama-quantize`` write them.

- :mod:`~convert.gguf.target`: :class:`~convert.gguf.target.GgufJob`, the target's job;
- :mod:`~convert.gguf.types`: the output type names (light: the command line imports only this);
- :mod:`~convert.gguf.plan`: every tensor's GGUF name, type and bytes, and the metadata, from headers;
- :mod:`~convert.gguf.general`: the ``general.*`` keys and the default file name's parts, as llama.cpp's
  converter makes them (model card, config.json, the name without its bnb words, ``--metadata``);
- :mod:`~convert.gguf.families`: the architecture table (one row of data per llama.cpp model class);
- :mod:`~convert.gguf.arch`, :mod:`~convert.gguf.rope`, :mod:`~convert.gguf.config`: what a row does to
  names, hyperparameters and weights, RoPE scaling, config.json checked against its GGUF types and the
  tensors; :mod:`~convert.gguf.loader`: the planned tensors against llama.cpp's loader (shapes, required);
- :mod:`~convert.gguf.mmproj`: the vision projector file (``--mmproj``); :mod:`~convert.gguf.split`: the
  parts of a split file (``--split-max-size``, ``--split-max-tensors``, as llama-gguf-split);
- :mod:`~convert.gguf.mix`: llama-quantize's per-tensor type mixes;
- :mod:`~convert.gguf.tokenizer`, :mod:`~convert.gguf.bpe_pre`, :mod:`~convert.gguf.bpe_table`: the
  tokenizer keys;
- :mod:`~convert.gguf.encode`, :mod:`~convert.gguf.rows`, :mod:`~convert.gguf.encoder_pool`: writing the
  file in row chunks (rows read from the stream sources; search types in worker processes);
- :mod:`convert.gguf.codecs`: one codec class per GGML type, in one table.
"""
