"""rlhf-server's vLLM endpoint plugin (vLLM 0.32's ``vllm.endpoint_plugins``): the routes a job syncs the vLLM
server it started through, and a key on every route. It runs in vLLM's own environment, where this folder is the
``PYTHONPATH`` and ``VLLM_PLUGINS=rlhf_sync`` (engine/core/vllm.py starts it so): it imports only vLLM, what vLLM
brings (fastapi, starlette) and the standard library, and nothing at import time.

vLLM offers its weight reload (``/collective_rpc``) and prefix-cache reset only in its dev mode, with ``/sleep``,
``/pause`` and the rest beside them, and its adapter loading (``/v1/load_lora_adapter``, ``/adapters``) from any
path only with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``; its ``VLLM_API_KEY`` guards the paths under ``/v1``, ``/v2``,
``/inference`` and ``/cohere`` alone (``/invocations`` samples without it). So the job's server runs with none of
those, and this plugin gives it:

- ``POST /v1/rlhf/reload_weights``: reload the weights in place from ``weights/`` beside the served model's folder;
- ``POST /v1/rlhf/load_adapter`` ``{"name"}``, ``POST /v1/rlhf/unload_adapter`` ``{"name"}``: a LoRA adapter from
  ``adapters/<name>`` there (names ``policy-<hex>-v<n>`` only);
- ``POST /v1/rlhf/reset_prefix_cache``;

and refuses (401) every request, on every path, without ``Authorization: Bearer <key>``, the key read at start
from the file ``key`` beside the server's Unix socket (``--uds``).
"""

import hashlib
import re
import secrets
from argparse import Namespace
from pathlib import Path
from typing import Any

ADAPTER_NAME = re.compile(r"policy-[0-9a-f]+-v[0-9]+")
"""The adapters' names (engine/core/vllm.py's VllmSampler): a folder's name under ``adapters/``, never a path."""


class RequireKey:
    """ASGI middleware: a request without the server's key is refused (401) before any route sees it."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            digest = getattr(scope["app"].state, "rlhf_key_digest", None)  # None: no key read, nothing passes
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            offered = hashlib.sha256(token).digest()
            if digest is None or scheme.lower() != b"bearer" or not secrets.compare_digest(offered, digest):
                from starlette.responses import JSONResponse

                await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RlhfSync:
    """The plugin (vLLM's ``EndpointPlugin`` protocol)."""

    name = "rlhf_sync"
    required_tasks = ("generate",)

    def attach_router(self, app: Any) -> None:
        from fastapi import APIRouter, Request
        from fastapi.responses import JSONResponse
        from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

        router = APIRouter()

        def adapter(body: dict[str, Any]) -> str | None:
            name = body.get("name")
            return name if isinstance(name, str) and ADAPTER_NAME.fullmatch(name) else None

        def answer(result: Any) -> Any:
            """vLLM's answer to an adapter request: a message, or an error response with its status."""
            if isinstance(result, str):
                return JSONResponse({"message": result})
            return JSONResponse(result.model_dump(), status_code=result.error.code)

        @router.post("/v1/rlhf/reload_weights")
        async def reload_weights(request: Request) -> Any:
            state = request.app.state
            await state.engine_client.collective_rpc("reload_weights", kwargs={"weights_path": state.rlhf_weights})
            return JSONResponse({"reloaded": state.rlhf_weights})

        @router.post("/v1/rlhf/reset_prefix_cache")
        async def reset_prefix_cache(request: Request) -> Any:
            return JSONResponse({"success": bool(await request.app.state.engine_client.reset_prefix_cache())})

        @router.post("/v1/rlhf/load_adapter")
        async def load_adapter(request: Request) -> Any:
            name = adapter(await request.json())
            if name is None:
                return JSONResponse({"error": f"an adapter's name is {ADAPTER_NAME.pattern}"}, status_code=400)
            folder = Path(request.app.state.rlhf_adapters) / name
            path = folder / "default" if (folder / "default").is_dir() else folder  # peft's folder per adapter
            models = request.app.state.openai_serving_models
            return answer(await models.load_lora_adapter(LoadLoRAAdapterRequest(lora_name=name, lora_path=str(path))))

        @router.post("/v1/rlhf/unload_adapter")
        async def unload_adapter(request: Request) -> Any:
            name = adapter(await request.json())
            if name is None:
                return JSONResponse({"error": f"an adapter's name is {ADAPTER_NAME.pattern}"}, status_code=400)
            models = request.app.state.openai_serving_models
            return answer(await models.unload_lora_adapter(UnloadLoRAAdapterRequest(lora_name=name)))

        app.include_router(router)
        app.add_middleware(RequireKey)

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        """The job's folders beside the served model's (``base/``), and the key beside the socket."""
        folder = Path(args.model).parent
        state.rlhf_weights = str(folder / "weights")
        state.rlhf_adapters = str(folder / "adapters")
        if args.uds:
            state.rlhf_key_digest = hashlib.sha256((Path(args.uds).parent / "key").read_bytes().strip()).digest()
