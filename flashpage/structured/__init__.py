"""Structured outputs (guided decoding): the output must match a regex, a JSON schema, a
context-free grammar or one of several strings.

regex_parser.py  a regex subset -> syntax tree          utf8.py      code point ranges -> byte ranges
automaton.py     tree -> byte NFA -> lazy DFA            json_schema.py, int_range.py  schema -> regex
vocab.py         each token's bytes                      guide.py     allowed tokens per DFA state
grammar_parser.py, lark_parser.py  GBNF / Lark text -> rules (the regex nodes + Ref)
grammar.py       rules -> checked -> inlined into a regex tree, or a pushdown automaton:
pushdown.py      configurations as lazily built DFA states (the same table guide.py walks)
compiler.py      StructuredOutputsParams -> CompiledGuide, cached per spec

Nothing here imports the engine; the engine imports this package only when a request asks
for structured outputs.
"""
