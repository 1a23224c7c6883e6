"""Embeddings offline and through the server (vLLM's LLM.embed and OpenAI's /v1/embeddings).

A decoder model's final hidden state pooled: the last token's by default, or mean / cls
(an embedding model's sentence-transformers config says which; --pooling-type overrides).
The default model is a chat model, so these vectors only show the API; point LLM at an
embedding model (e.g. a Qwen3-Embedding folder) for useful ones.
"""

import torch

from flashpage import LLM, PoolingParams

llm = LLM()
docs = ["Paris is the capital of France.", "The Eiffel Tower is in Paris.", "Bananas are yellow."]
query = "Which city has the Eiffel Tower?"
outs = llm.embed([query, *docs], PoolingParams(normalize=True))
vecs = torch.tensor([o.outputs.embedding for o in outs])
scores = vecs[1:] @ vecs[0]  # cosine similarity: the vectors have unit length
for doc, s in sorted(zip(docs, scores.tolist(), strict=True), key=lambda x: -x[1]):
    print(f"{s:.3f}  {doc}")

# Served: flashpage serve &  then
#   from openai import OpenAI
#   client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
#   client.embeddings.create(model="SmolLM2-135M-Instruct", input=docs, dimensions=256)
