"""Adapters added and removed while the server runs (vLLM's runtime LoRA updating):
POST /v1/load_lora_adapter {"lora_name", "lora_path"} and /v1/unload_lora_adapter
{"lora_name"}, present only with FLASHPAGE_ALLOW_RUNTIME_LORA_UPDATING=1 (or vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING) and answered as vLLM answers them (plain-text success).

A loaded adapter is read and checked on the engine thread before its name is served (a
bad folder is a 400 with the reason); each gets a fresh id, so a name unloaded and loaded
again from another folder never meets the old copy. Unloading stops new requests naming
it at once; requests already running with it finish with it.
"""

from __future__ import annotations

from fastapi.responses import PlainTextResponse, Response

from flashpage.lora.request import LoRARequest
from flashpage.server.protocol import (
    APIError,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
    bad_request,
)
from flashpage.server.serving import ServerState


def _check_enabled(state: ServerState, param: str) -> None:
    if state.engine.engine.lora is None:
        raise bad_request("the server was started without --enable-lora: no adapter can be "
                          "loaded", param)


async def load_lora_adapter(state: ServerState, req: LoadLoRAAdapterRequest) -> Response:
    _check_enabled(state, "lora_name")
    name = req.lora_name
    if name in state.lora_modules:
        raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
    if name == state.model_name:
        raise bad_request(f"'{name}' is the served model's name: give the adapter its own",
                          "lora_name")
    state.lora_ids += 1
    lora = LoRARequest(name, state.lora_ids, req.lora_path)
    try:
        await state.engine.call(lambda engine: engine.add_lora(lora))
    except ValueError as e:
        raise bad_request(f"could not load LoRA adapter '{name}': {e}", "lora_path") from None
    if name in state.lora_modules:  # the same name loaded by a concurrent call meanwhile
        raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
    state.lora_modules[name] = lora
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(state: ServerState, req: UnloadLoRAAdapterRequest) -> Response:
    _check_enabled(state, "lora_name")
    lora = state.lora_modules.pop(req.lora_name, None)
    if lora is None:
        raise APIError(404, f"The lora adapter '{req.lora_name}' cannot be found.",
                       "NotFoundError", "lora_name")
    await state.engine.call(lambda engine: engine.remove_lora(lora.lora_int_id))
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
