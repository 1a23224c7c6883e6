"""Structured outputs (guided decoding): the output must match a regex, a JSON schema or
one of several strings.

regex_parser.py  a regex subset -> syntax tree          utf8.py      code point ranges -> byte ranges
automaton.py     tree -> byte NFA -> lazy DFA            json_schema.py, int_range.py  schema -> regex
vocab.py         each token's bytes                      guide.py     allowed tokens per DFA state
compiler.py      StructuredOutputsParams -> CompiledGuide, cached per spec

Nothing here imports the engine; the engine imports this package only when a request asks
for structured outputs.
"""
