"""A user's own supervised loop with the official ``tinker`` SDK (0.38) against ``rlhf serve``: a LoRA training
client on a chat model of the model root, cross-entropy on the assistant's tokens only, Adam steps, then the
weights saved for sampling, sampled through the SDK and chatted with through the OpenAI endpoints.

    RLHF_MODEL_ROOT=models rlhf serve &     # models/qwen: a causal LM whose tokenizer has a chat template
    python examples/tinker_sft.py --model qwen

The key is the project key of ``rlhf-data/api-key`` given to the SDK as ``tml-<key>``.
"""

import argparse
from pathlib import Path
from typing import Any

import tinker
from openai import OpenAI
from tinker import types

PAIRS = [("Say yes", "yes yes yes"), ("Say no", "no no no"), ("Say maybe", "maybe maybe"), ("Say ok", "ok ok")]


def render(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool = False) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def datum(tokenizer: Any, prompt: str, answer: str) -> types.Datum:
    """The conversation as next-token targets, weighted 1 on the assistant's tokens and 0 on the prompt's."""
    user = [{"role": "user", "content": prompt}]
    context = render(tokenizer, user, generation_prompt=True)
    tokens = render(tokenizer, [*user, {"role": "assistant", "content": answer}])
    weights = [0.0] * (len(context) - 1) + [1.0] * (len(tokens) - len(context))
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", required=True, help="a folder under the server's model root, or builtin:tiny")
    parser.add_argument("--api-key", default=None, help="the project key (default: rlhf-data/api-key)")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    key = args.api_key or Path("rlhf-data/api-key").read_text().strip()

    service = tinker.ServiceClient(base_url=args.url, api_key=f"tml-{key}")
    rest = tinker.RestClient(base_url=args.url, api_key=f"tml-{key}")
    print("trainable here:", [m.model_name for m in rest.get_server_capabilities().result().supported_models])
    training = service.create_lora_training_client(base_model=args.model, rank=8).result()
    tokenizer = training.get_tokenizer()
    data = [datum(tokenizer, prompt, answer) for prompt, answer in PAIRS]
    weighted = sum(sum(d.loss_fn_inputs["weights"].data) for d in data)
    for step in range(args.steps):
        # both requests go out at once; the server runs them in the order they were made
        fwdbwd = training.forward_backward(data, "cross_entropy")
        optim = training.optim_step(types.AdamParams(learning_rate=5e-3))
        loss = fwdbwd.result().metrics["loss:sum"] / weighted
        optim.result()
        print(f"step {step + 1}: loss per token {loss:.3f}")

    saved = training.save_weights_for_sampler("example").result()
    print("sampler weights:", saved.path)
    sampler = service.create_sampling_client(model_path=saved.path).result()
    prompt = types.ModelInput.from_ints(render(tokenizer, [{"role": "user", "content": "Say yes"}], True))
    reply = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=8, temperature=0)).result()
    print("sampled:", tokenizer.decode(reply.sequences[0].tokens))

    session_id = training.model_id.split(":")[0]  # the session is a job of type "session"
    # its first sampler weights are the session job's checkpoint 1 (GET /v1/jobs/{id}/checkpoints lists them)
    chat = OpenAI(base_url=f"{args.url}/v1", api_key=key).chat.completions.create(
        model=f"job:{session_id}@1", messages=[{"role": "user", "content": "Say yes"}], max_tokens=8, temperature=0
    )
    print("chat:", chat.choices[0].message.content)
    service.close("success").result()


if __name__ == "__main__":
    main()
