"""A ChatTemplate as a Hugging Face Jinja chat template: an export's ``chat_template.jinja``.

``hf_chat_template(template)`` renders the same text as ``template.render`` for the same
conversation, so ``apply_chat_template`` on an exported model reproduces what it was trained on:
the default system prompt, media placeholders (numbered audio too; a turn's media first where the
template says so), ``<think>`` rules, trimmed turns, the generation prompt, and — for a template with ``tool_style: qwen`` — the ``tools``
variable in the system prompt, assistant ``tool_calls`` in ``<tool_call>`` wrappers and
consecutive ``tool`` results in one user turn, as data/text/tools.py renders them for training.

Messages are HF-style: ``content`` is a string (``<image>`` / ``<video>`` / ``<audio>`` placeholders
expand as in training) or a list of ``{"type": "text" | "image" | "video" | "audio"}`` parts; the
role ``tool`` is ``observation``. Unknown roles and part types raise, as they do in training.
"""

from __future__ import annotations

import json

from omniweave.data.sample import ROLES
from omniweave.data.text.tools import QWEN_TOOLS


def hf_chat_template(template) -> str:
    roles = {role: getattr(template, role).split("{content}") for role in ROLES}
    roles["tool"] = roles["observation"]
    default_system = None
    if template.default_system is not None:
        default_system = template.system.format(content=template.default_system)
    tools_head, tools_tail = QWEN_TOOLS.split("{tools}")
    constants = {"name": template.name, "bos": template.bos, "roles": roles, "default_system": default_system,
                 "default_system_text": template.default_system or "", "tools_head": tools_head,
                 "tools_tail": tools_tail, "image": template.processor_image or template.image, "video": template.processor_video or template.video, "audio": template.audio,
                 "generation": template.generation_header()}  # fmt: skip
    qwen_tools = template.tool_style == "qwen"
    # JSON string escapes are Jinja string escapes; non-ASCII stays literal (Jinja re-escapes it)
    literal = json.dumps(constants, ensure_ascii=False)
    return (
        "{#- omniweave chat template t.name (omniweave/data/text/template.py): the text the model was trained on -#}\n"
        f"{{%- set t = {literal} -%}}\n"
        "{{- t.bos -}}\n"
        "{%- set ns = namespace(last_query=messages | length - 1, audios=0, start=0) -%}\n"
        + (_TOOLS_SYSTEM if qwen_tools else "{%- if false -%}\n")
        + "{%- elif t.default_system is not none and (messages | length == 0 or messages[0]['role'] != 'system') -%}\n"
        "{{- t.default_system -}}\n"
        "{%- endif -%}\n"
        "{%- for message in messages -%}{%- if message['role'] == 'user' -%}{%- set ns.last_query = loop.index0 -%}"
        "{%- endif -%}{%- endfor -%}\n"
        "{%- for message in messages[ns.start:] -%}\n"
        "{%- set k = loop.index0 + ns.start -%}\n"
        "{%- if message['role'] not in t.roles -%}{{- raise_exception('unknown role ' ~ message['role']) -}}{%- endif -%}\n"
        + (_TOOL_RESULT_OPEN if qwen_tools else "{{- t.roles[message['role']][0] -}}\n")
        + _CONTENT
        + (_TOOL_CALLS if qwen_tools else "")
        + _THINK.get(template.think_style, "")
        + ("{%- set c = c | trim -%}\n" if template.trim_content else "")
        + (_MEDIA_FIRST if template.media_first else "")
        + _EMIT["{index}" in template.audio]
        + (_TOOL_RESULT_CLOSE if qwen_tools else "{{- t.roles[message['role']][1] -}}\n")
        + "{%- endfor -%}\n"
        "{%- if add_generation_prompt -%}{{- t.generation -}}{%- endif -%}\n"
    )


# the message's content as one string ``c``, content parts joined with our placeholders
_CONTENT = (
    "{%- if message['content'] is string -%}{%- set c = message['content'] -%}\n"
    "{%- elif message['content'] is none -%}{%- set c = '' -%}\n"
    "{%- else -%}{%- set parts = namespace(text='') -%}{%- for part in message['content'] -%}\n"
    "{%- if part['type'] in ['image', 'video', 'audio'] -%}{%- set parts.text = parts.text ~ '<' ~ part['type'] ~ '>' -%}\n"
    "{%- elif part['type'] == 'text' -%}{%- set parts.text = parts.text ~ part['text'] -%}\n"
    "{%- else -%}{{- raise_exception('unsupported content part ' ~ part['type']) -}}\n"
    "{%- endif -%}{%- endfor -%}{%- set c = parts.text -%}{%- endif -%}\n"
)

# tools.apply_tool_style("qwen"): the definitions join the system prompt (the first turn, when a system one)
_TOOLS_SYSTEM = (
    "{%- if tools -%}\n"
    "{%- set sys = namespace(text=t.default_system_text) -%}\n"
    "{%- if messages and messages[0]['role'] == 'system' -%}{%- set ns.start = 1 -%}\n"
    "{%- set sys.text = messages[0]['content'] if messages[0]['content'] is string else "
    "messages[0]['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') -%}\n"
    "{%- endif -%}\n"
    "{{- t.roles['system'][0] ~ ((sys.text ~ '\\n\\n') if sys.text else '') ~ t.tools_head -}}\n"
    "{%- for tool in tools -%}{{- '\\n' ~ (tool | tojson) -}}{%- endfor -%}\n"
    "{{- t.tools_tail ~ t.roles['system'][1] -}}\n"
)
# a run of tool results is one user turn: the observation header before the first, the footer after the last
_TOOL_RESULT_OPEN = (
    "{%- if message['role'] != 'tool' or k == 0 or messages[k - 1]['role'] != 'tool' -%}"
    "{{- t.roles[message['role']][0] -}}{%- endif -%}\n"
)
_TOOL_RESULT_CLOSE = (
    "{%- if message['role'] == 'tool' and not loop.last and messages[k + 1]['role'] == 'tool' -%}"
    "{{- '\\n</tool_response>\\n<tool_response>\\n' -}}\n"
    "{%- else -%}{{- t.roles[message['role']][1] -}}{%- endif -%}\n"
)
# an assistant's calls after its text, each {"name": …, "arguments": …} in <tool_call> tags
_TOOL_CALLS = (
    "{%- if message['tool_calls'] -%}{%- set acc = namespace(text=c) -%}{%- for call in message['tool_calls'] -%}\n"
    "{%- set call = call['function'] if call['function'] is defined else call -%}\n"
    "{%- set args = call['arguments'] if call['arguments'] is string else call['arguments'] | tojson -%}\n"
    "{%- set acc.text = acc.text ~ ('\\n' if acc.text else '') ~ '<tool_call>\\n{\"name\": \"' ~ call['name'] "
    "~ '\", \"arguments\": ' ~ args ~ '}\\n</tool_call>' -%}\n"
    "{%- endfor -%}{%- set c = acc.text -%}{%- endif -%}\n"
)

# template.media_first: the turn's images, then videos, then audio, then its text without them
_MEDIA_FIRST = (
    "{%- set c = '<image>' * (c.split('<image>') | length - 1) ~ '<video>' * (c.split('<video>') | length - 1) "
    "~ '<audio>' * (c.split('<audio>') | length - 1) ~ (c | replace('<image>', '') | replace('<video>', '') "
    "| replace('<audio>', '')) -%}\n"
)

# a turn's text with its placeholders expanded; numbered audio: ``t.audio`` around its {index}
_EMIT = {
    False: "{{- c | replace('<image>', t.image) | replace('<video>', t.video) | replace('<audio>', t.audio) -}}\n",
    True: ("{%- for piece in c.split('<audio>') -%}\n"
           "{%- if not loop.first -%}{%- set ns.audios = ns.audios + 1 -%}"
           "{{- t.audio.split('{index}')[0] ~ ns.audios ~ t.audio.split('{index}')[1] -}}{%- endif -%}\n"
           "{{- piece | replace('<image>', t.image) | replace('<video>', t.video) -}}\n"
           "{%- endfor -%}\n"),
}

# template.apply_think_style: ``c`` is the turn's text, ``k`` its index, ``ns.last_query`` the last user turn
_THINK = {
    "qwen3": (
        "{%- if message['role'] in ['assistant', 'function'] -%}\n"
        "{%- set r = '' -%}\n"
        "{%- if '</think>' in c -%}\n"
        "{%- set r = c.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}\n"
        "{%- set c = c.split('</think>')[-1].lstrip('\\n') -%}\n"
        "{%- endif -%}\n"
        "{%- if k > ns.last_query and (k == messages | length - 1 or r) -%}\n"
        "{%- set c = '<think>\\n' + r.strip('\\n') + '\\n</think>\\n\\n' + c.lstrip('\\n') -%}\n"
        "{%- endif -%}\n"
        "{%- endif -%}\n"
    ),
    "drop": "{%- if message['role'] == 'assistant' -%}{%- set c = c.split('</think>')[-1] -%}{%- endif -%}\n",
}
