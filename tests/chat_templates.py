"""Chat templates of real instruct models, written out (nothing is downloaded), and tokenizers that use them.

Each template reproduces, in substance, the public ``chat_template`` of the model named above it: the parts that
decide how a conversation becomes text (role markers, Qwen3 dropping the ``<think>`` block of earlier assistant
turns, Gemma 2 refusing a system turn, the default system blocks of Llama 3.1, SmolLM3 and Granite). Tool calling
and documents are left out.

    tokenizer = chat_tokenizer("qwen3", tmp_path / "qwen3")  # AutoTokenizer loads the folder
"""

# ruff: noqa: E501  (the templates keep their models' long lines)

from pathlib import Path

from transformers import PreTrainedTokenizerFast

from tests.models import build_tokenizer

# Qwen/Qwen3-8B: ChatML; the reasoning of an assistant turn after the last user query is written as a
# <think> block (an empty one for the final turn), earlier turns lose theirs.
QWEN3 = """\
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

# microsoft/Phi-3.5-mini-instruct (and Phi-3-mini-128k-instruct): a conversation rendered without the
# generation prompt ends with EOS, so a shorter conversation's rendering is not the start of a longer one's.
PHI3 = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and message['content'] %}{{'<|system|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)

# google/gemma-2-2b-it: no system role, strictly alternating user/model turns, contents trimmed.
GEMMA2 = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)

# meta-llama/Llama-3.1-8B-Instruct: a system block is always written, with the knowledge cutoff and a date.
LLAMA31 = """\
{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}"""

# HuggingFaceTB/SmolLM3-3B: a metadata and instructions system block on every conversation; the assistant turns in
# {% generation %} blocks; /think (the default) or /no_think chosen in the system message or by enable_thinking.
SMOLLM3 = """\
{%- if enable_thinking is not defined -%}
{%- set enable_thinking = true -%}
{%- endif -%}
{%- if enable_thinking -%}
  {%- set reasoning_mode = "/think" -%}
{%- else -%}
  {%- set reasoning_mode = "/no_think" -%}
{%- endif -%}
{{- "<|im_start|>system\\n" -}}
{%- if messages[0].role == "system" -%}
  {%- set system_message = messages[0].content -%}
  {%- if "/no_think" in system_message -%}
    {%- set reasoning_mode = "/no_think" -%}
  {%- elif "/think" in system_message -%}
    {%- set reasoning_mode = "/think" -%}
  {%- endif -%}
  {%- set custom_instructions = system_message.replace("/no_think", "").replace("/think", "").rstrip() -%}
{%- endif -%}
{%- if "/system_override" in system_message -%}
  {{- custom_instructions.replace("/system_override", "").rstrip() -}}
  {{- "<|im_end|>\\n" -}}
{%- else -%}
  {{- "## Metadata\\n\\n" -}}
  {{- "Knowledge Cutoff Date: June 2025\\n" -}}
  {%- set today = strftime_now("%d %B %Y") -%}
  {{- "Today Date: " ~ today ~ "\\n" -}}
  {{- "Reasoning Mode: " + reasoning_mode + "\\n\\n" -}}
  {{- "## Custom Instructions\\n\\n" -}}
  {%- if custom_instructions -%}
    {{- custom_instructions + "\\n\\n" -}}
  {%- elif reasoning_mode == "/think" -%}
    {{- "You are a helpful AI assistant named SmolLM, trained by Hugging Face. Your role as an assistant involves thoroughly exploring questions through a systematic thinking process before providing the final precise and accurate solutions. This requires engaging in a comprehensive cycle of analysis, summarizing, exploration, reassessment, reflection, backtracking, and iteration to develop well-considered thinking process. Please structure your response into two main sections: Thought and Solution using the specified format: <think> Thought section </think> Solution section. In the Thought section, detail your reasoning process in steps. Each step should include detailed considerations such as analysing questions, summarizing relevant findings, brainstorming new ideas, verifying the accuracy of the current steps, refining any errors, and revisiting previous steps. In the Solution section, based on various attempts, explorations, and reflections from the Thought section, systematically present the final solution that you deem correct. The Solution section should be logical, accurate, and concise and detail necessary steps needed to reach the conclusion.\\n\\n" -}}
  {%- else -%}
    {{- "You are a helpful AI assistant named SmolLM, trained by Hugging Face.\\n\\n" -}}
  {%- endif -%}
  {{- "<|im_end|>\\n" -}}
{%- endif -%}
{%- for message in messages -%}
    {%- set content = message.content if message.content is string else "" -%}
    {%- if message.role == "user" -%}
        {{ "<|im_start|>" + message.role + "\\n"  + content + "<|im_end|>\\n" }}
    {%- elif message.role == "assistant" -%}
        {% generation %}
        {%- if reasoning_mode == "/think" -%}
            {{ "<|im_start|>assistant\\n" + content.lstrip("\\n") + "<|im_end|>\\n" }}
        {%- else -%}
            {{ "<|im_start|>assistant\\n" + "<think>\\n\\n</think>\\n" + content.lstrip("\\n") + "<|im_end|>\\n" }}
        {%- endif -%}
        {% endgeneration %}
    {%- elif message.role == "tool" -%}
    {{ "<|im_start|>" + "user\\n"  + content + "<|im_end|>\\n" }}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {%- if reasoning_mode == "/think" -%}
        {{ "<|im_start|>assistant\\n" }}
    {%- else -%}
        {{ "<|im_start|>assistant\\n" + "<think>\\n\\n</think>\\n" }}
    {%- endif -%}
{%- endif -%}"""

# ibm-granite/granite-3.1-8b-instruct: a default system block (knowledge cutoff, today's date, "You are Granite")
# when the conversation has none.
GRANITE = """\
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system_message = "Knowledge Cutoff Date: April 2024.\\nToday's Date: " + strftime_now('%B %d, %Y') + ".\\nYou are Granite, developed by IBM." %}
    {%- set system_message = system_message + " You are a helpful AI assistant." %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- '<|start_of_role|>system<|end_of_role|>' + system_message + '<|end_of_text|>\\n' }}
{%- for message in loop_messages %}
    {{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + message['content'] + '<|end_of_text|>\\n' }}
    {%- if loop.last and add_generation_prompt %}
        {{- '<|start_of_role|>assistant' }}
        {%- if controls %}
            {{- ' ' + controls | tojson()}}
        {%- endif %}
        {{- '<|end_of_role|>' }}
    {%- endif %}
{%- endfor %}"""

TEMPLATES = {
    "qwen3": QWEN3,
    "phi3": PHI3,
    "gemma2": GEMMA2,
    "llama3.1": LLAMA31,
    "smollm3": SMOLLM3,
    "granite": GRANITE,
}
"""Template name → the model's chat template."""

SPECIAL_TOKENS: dict[str, dict[str, str | list[str]]] = {
    "qwen3": {"eos": "<|im_end|>", "extra": ["<|im_start|>", "<think>", "</think>"]},
    "phi3": {"eos": "<|endoftext|>", "extra": ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]},
    "gemma2": {"bos": "<bos>", "eos": "<eos>", "extra": ["<start_of_turn>", "<end_of_turn>"]},
    "llama3.1": {
        "bos": "<|begin_of_text|>",
        "eos": "<|eot_id|>",
        "extra": ["<|start_header_id|>", "<|end_header_id|>"],
    },
    "smollm3": {"eos": "<|im_end|>", "extra": ["<|im_start|>"]},
    "granite": {"eos": "<|end_of_text|>", "extra": ["<|start_of_role|>", "<|end_of_role|>"]},
}
"""Template name → the special tokens it writes: ``bos`` and ``eos`` (the tokenizer's), ``extra`` (the others)."""


def chat_tokenizer(name: str, folder: Path) -> Path:
    """The tests' byte-level BPE tokenizer (``tests.models.build_tokenizer``) with the chat template ``name`` and
    the special tokens it writes (each one token), saved in ``folder``."""
    build_tokenizer(folder)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    tokens = SPECIAL_TOKENS[name]
    extra = tokens["extra"]
    assert isinstance(extra, list)
    added: dict[str, str] = {key: str(tokens[key]) for key in ("bos", "eos") if key in tokens}
    tokenizer.add_special_tokens(
        {"additional_special_tokens": extra, **{f"{key}_token": token for key, token in added.items()}}
    )
    tokenizer.chat_template = TEMPLATES[name]
    tokenizer.save_pretrained(folder)
    return folder
