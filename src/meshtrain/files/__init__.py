"""Every file meshtrain reads or writes goes through here.

* :mod:`~meshtrain.files.text` -- bytes to text: UTF-8 with or without a BOM, UTF-16/32
  with a BOM (converted, whole or streamed), invalid bytes and empty files named with
  file, line and column.
* :mod:`~meshtrain.files.structured` -- JSON, YAML and JSON lines on top of it: duplicate
  keys refused with both positions, truncated documents named as such.
* :mod:`~meshtrain.files.writable` -- checks that an output folder or file can be written
  (parent, permissions, free space) before any work starts.
* :mod:`~meshtrain.files.tokenizer_files` -- a tokenizer's files read strictly before
  ``transformers``/``tokenizers`` parse them (encodings, truncation, duplicate keys, a token
  twice in ``vocab.txt``).
* :mod:`~meshtrain.files.checksums` -- the hash every artifact carries (xxh3-64), streamed
  while writing, and the sealed JSON that carries its own checksum.

Each function takes the exception class to raise (``ConfigError`` for a config,
``DataError`` for data, ...) so the caller's error type stays what its users catch.
"""
