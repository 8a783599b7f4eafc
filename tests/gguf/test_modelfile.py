"""``--modelfile``: the Ollama Modelfile written beside a GGUF (convert/gguf/modelfile.py, convert/gguf/ollama.py).

Each family's Modelfile is checked as a whole text against the template Ollama itself ships for that family (the
``OLLAMA_*`` texts below: github.com/ollama/ollama ``template/NAME.gotmpl`` at the commit named in
:data:`OLLAMA`, with the stop strings of its ``template/NAME.json``), for a fixture model of that architecture
given the real model's chat template (tests/fixtures/chat_templates, README there). No ``ollama`` binary is
installed here, so what Ollama reads back is checked with a port of its Modelfile parser
(:func:`ollama_request`: ``parser/parser.go`` ``ParseFile`` and ``CreateRequest``).
"""

from __future__ import annotations

import hashlib
import json
import os
import unicodedata
from pathlib import Path
from typing import Any

import pytest

from convert.cli import main
from convert.gguf.modelfile import make_modelfile
from convert.gguf.ollama import TEMPLATES, recognise
from convert.job import convert
from convert.options import ConvertOptions
from convert.output import sha256_file
from formats import errors as E
from tests.helpers.fixtures import FIXTURES, MODELS
from tests.helpers.hubcache import offline_env, run_cli

CHAT_TEMPLATES = FIXTURES / "chat_templates"

# ------------------------------------------------------------------ Ollama's templates, as Ollama ships them

OLLAMA_CHATML = (
    "{{- range .Messages }}<|im_start|>{{ .Role }}\n"
    "{{ .Content }}<|im_end|>\n"
    "{{ end }}<|im_start|>assistant\n"
)
OLLAMA_LLAMA3_INSTRUCT = (
    "{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n"
    "\n"
    "{{ .Content }}<|eot_id|>\n"
    "{{- end }}<|start_header_id|>assistant<|end_header_id|>\n"
    "\n"
)
OLLAMA_MISTRAL_INSTRUCT = (
    "[INST] {{ range $index, $_ := .Messages }}\n"
    "{{- if eq .Role \"system\" }}{{ .Content }}\n"
    "\n"
    "{{ else if eq .Role \"user\" }}{{ .Content }}[/INST]\n"
    "{{- else if eq .Role \"assistant\" }} {{ .Content }}</s>[INST] {{ end }}\n"
    "{{- end }}"
)
OLLAMA_LLAMA2_CHAT = (
    "{{- $system := \"\" }}[INST] {{ range .Messages }}\n"
    "{{- if eq .Role \"system\" }}\n"
    "{{- if not $system }}{{ $system = .Content }}\n"
    "{{- else }}{{ $system = printf \"%s\\n\\n%s\" $system .Content }}\n"
    "{{- end }}\n"
    "{{- else if eq .Role \"user\" }}<<SYS>>\n"
    "{{- if $system }}\n"
    "{{ $system }}\n"
    "{{ $system = \"\" }}\n"
    "{{- end }}<</SYS>>\n"
    "\n"
    "{{ .Content }} [/INST]\n"
    "{{- else if eq .Role \"assistant\" }} {{ .Content }}</s><s>[INST] {{ end }}\n"
    "{{- end }}"
)
OLLAMA_GEMMA_INSTRUCT = (
    "{{- $system := \"\" }}\n"
    "{{- range .Messages }}\n"
    "{{- if eq .Role \"system\" }}\n"
    "{{- if not $system }}{{ $system = .Content }}\n"
    "{{- else }}{{ $system = printf \"%s\\n\\n%s\" $system .Content }}\n"
    "{{- end }}\n"
    "{{- continue }}\n"
    "{{- else if eq .Role \"user\" }}<start_of_turn>user\n"
    "{{- if $system }}\n"
    "{{ $system }}\n"
    "{{- $system = \"\" }}\n"
    "{{- end }}\n"
    "{{- else if eq .Role \"assistant\" }}<start_of_turn>model\n"
    "{{- end }}\n"
    "{{ .Content }}<end_of_turn>\n"
    "{{ end }}<start_of_turn>model\n"
)
OLLAMA_GEMMA3_INSTRUCT = (
    "{{- range $i, $_ := .Messages }}\n"
    "{{- $last := eq (len (slice $.Messages $i)) 1 }}\n"
    "{{- if eq .Role \"user\" }}<start_of_turn>user\n"
    "{{- if and (eq $i 1) $.System }}\n"
    "{{ $.System }}\n"
    "{{ end }}\n"
    "{{ .Content }}<end_of_turn>\n"
    "{{ else if eq .Role \"assistant\" }}<start_of_turn>model\n"
    "{{ .Content }}<end_of_turn>\n"
    "{{ end }}\n"
    "{{- if $last }}<start_of_turn>model\n"
    "{{ end }}\n"
    "{{- end }}\n"
)
OLLAMA_PHI_3 = (
    "{{- range .Messages }}<|{{ .Role }}|>\n"
    "{{ .Content }}<|end|>\n"
    "{{ end }}<|assistant|>\n"
)
OLLAMA_COMMAND_R = (
    "{{- if or .Tools .System }}<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>\n"
    "{{- if .Tools }}# Safety Preamble\n"
    "The instructions in this section override those in the task description and style "
    "guide sections. Don't answer questions that are harmful or immoral.\n"
    "\n"
    "# System Preamble\n"
    "## Basic Rules\n"
    "You are a powerful conversational AI trained by Cohere to help people. You are "
    "augmented by a number of tools, and your job is to use and consume the output of "
    "these tools to best help the user. You will see a conversation history between "
    "yourself and a user, ending with an utterance from the user. You will then see a "
    "specific instruction instructing you what kind of response to generate. When you "
    "answer the user's requests, you cite your sources in your answers, according to those "
    "instructions.\n"
    "\n"
    "{{ if .System }}# User Preamble\n"
    "{{ .System }}\n"
    "{{- end }}\n"
    "\n"
    "## Available Tools\n"
    "Here is a list of tools that you have available to you:\n"
    "{{- range .Tools }}\n"
    "\n"
    "```python\n"
    "def {{ .Function.Name }}(\n"
    "{{- range $name, $property := .Function.Parameters.Properties }}{{ $name }}: {{ "
    "$property.Type }}, {{ end }}) -> List[Dict]:\n"
    "    '''{{ .Function.Description }}\n"
    "\n"
    "{{- if .Function.Parameters.Properties }}\n"
    "\n"
    "    Args:\n"
    "{{- range $name, $property := .Function.Parameters.Properties }}\n"
    "        {{ $name }} ({{ $property.Type }}): {{ $property.Description }}\n"
    "{{- end }}\n"
    "{{- end }}\n"
    "    '''\n"
    "    pass\n"
    "```\n"
    "{{- end }}\n"
    "{{- else if .System }}{{ .System }}\n"
    "{{- end }}<|END_OF_TURN_TOKEN|>\n"
    "{{- end }}\n"
    "{{- range .Messages }}\n"
    "{{- if eq .Role \"system\" }}\n"
    "{{- continue }}\n"
    "{{- end }}<|START_OF_TURN_TOKEN|>\n"
    "{{- if eq .Role \"user\" }}<|USER_TOKEN|>{{ .Content }}\n"
    "{{- if $.Tools }}<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>Write 'Action:' followed by a "
    "json-formatted list of actions that you want to perform in order to produce a good "
    "response to the user's last input. You can use any of the supplied tools any number "
    "of times, but you should aim to execute the minimum number of necessary actions for "
    "the input. You should use the `directly-answer` tool if calling the other tools is "
    "unnecessary. The list of actions you want to call should be formatted as a list of "
    "json objects, for example:\n"
    "```json\n"
    "[\n"
    "    {\n"
    "        \"tool_name\": title of the tool in the specification,\n"
    "        \"parameters\": a dict of parameters to input into the tool as they are defined "
    "in the specs, or {} if it takes no parameters\n"
    "    }\n"
    "]```\n"
    "{{- end }}\n"
    "{{- else if eq .Role \"assistant\" }}<|CHATBOT_TOKEN|>\n"
    "{{- if .Content }}{{ .Content }}\n"
    "{{- else if .ToolCalls }}\n"
    "Action: ```json\n"
    "[\n"
    "{{- range .ToolCalls }}\n"
    "    {\n"
    "        \"tool_name\": \"{{ .Function.Name }}\",\n"
    "        \"parameters\": {{ .Function.Arguments }}\n"
    "    }\n"
    "{{- end }}\n"
    "]```\n"
    "{{- end }}\n"
    "{{- else if eq .Role \"tool\" }}<|SYSTEM_TOKEN|><results>\n"
    "console_output: {{ .Content }}\n"
    "</results>\n"
    "{{- end }}<|END_OF_TURN_TOKEN|>\n"
    "{{- end }}<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>\n"
)

#: name -> (the text, its sha256, the ollama/ollama commit of template/NAME.gotmpl it was read at, the stop strings of
#: template/NAME.json: chatml.json at e1e0d59a, llama3-instruct.json at 75d1b796, llama2-chat.json at f4d852dc,
#: gemma-instruct.json at b94e7ece, gemma3-instruct.json at 11a3c733, phi-3.json at 41f885f2, command-r.json at
#: f7cc50a7; mistral-instruct has no .json)
OLLAMA: dict[str, tuple[str, str, str, tuple[str, ...]]] = {
    "chatml": (OLLAMA_CHATML, "e3b2721cec511e3a627ae0993753abbf5c72cdf4cfcdbc8f5c33ce15c4c4e04b",
               "9fbfa74219fa74d030c816cc99d3bee0d1c1923d", ("<|im_start|>", "<|im_end|>")),
    "llama3-instruct": (OLLAMA_LLAMA3_INSTRUCT, "61dc7b1a77154f4015bbf548fb63b33550162cfd5d6cbf59b7e7843ece99a49e",
                        "888b6fbb5a1ab1d84ef790e2d38ced189b32b027",
                        ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")),
    "mistral-instruct": (OLLAMA_MISTRAL_INSTRUCT, "c502cd9313888317b670db1c6d5698783656a22ea75101651baa2c94d42397fb",
                         "75d1b79659f6b4e5459f8908b394f1cb75e878ef", ()),
    "llama2-chat": (OLLAMA_LLAMA2_CHAT, "3f74e056f96c687f67c49ed8309407e0612611e94b910464d8a3d9b60b46d7a6",
                    "888b6fbb5a1ab1d84ef790e2d38ced189b32b027", ("[INST]", "[/INST]", "<<SYS>>", "<</SYS>>")),
    "gemma-instruct": (OLLAMA_GEMMA_INSTRUCT, "4ea0df93422f8340a23cbb30feb814196a03aed2e1d97382b6529fad7c541f79",
                       "41f885f20344177b5f9ce128f21006b166e3d9a2", ("<start_of_turn>", "<end_of_turn>")),
    "gemma3-instruct": (OLLAMA_GEMMA3_INSTRUCT, "680a6206c5762f5a0915d25b2e5d85f8a1aecbc07a03a504bcbe21b5796b34ca",
                        "a10ddf2577f8addefdbf352c5cfe5712ecb72388", ("<end_of_turn>",)),
    "phi-3": (OLLAMA_PHI_3, "35360843d0c84fb1506952a131bbef13cd2bb4a541251f22535170c05b56e672",
              "c3b52859c84826a9a98139203acb99bd1c316efe", ("<|end|>", "<|system|>", "<|user|>", "<|assistant|>")),
    "command-r": (OLLAMA_COMMAND_R, "cedc23829af01ffb7ac6cc9e79b07ac5f306bf37e11bddb93ec072dd4f8fc756",
                  "f7cc50a7e64c6fc9e68b1bad96027de2f2c69505", ("<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>")),
}


def test_the_module_holds_ollamas_templates_byte_for_byte() -> None:
    assert set(TEMPLATES) == set(OLLAMA)
    for name, (text, sha, commit, stop) in OLLAMA.items():
        assert hashlib.sha256(text.encode()).hexdigest() == sha, name  # (this copy is Ollama's file)
        t = TEMPLATES[name]
        assert (t.text, t.sha256, t.commit, t.stop) == (text, sha, commit, stop), name


# ------------------------------------------------------------------ Ollama's Modelfile parser, ported to read back


def _unquote(s: str) -> tuple[str, bool]:
    """parser.go ``unquote``: triple quotes, then single quotes, no escapes."""
    if s.startswith('"""'):
        return (s[3:-3], True) if len(s) >= 6 and s.endswith('"""') else ("", False)
    if s.startswith('"'):
        return (s[1:-1], True) if len(s) >= 2 and s.endswith('"') else ("", False)
    return s, True


def _printable(r: str) -> bool:
    """Go's ``strconv.IsPrint``: letters, marks, numbers, punctuation, symbols and the ASCII space."""
    return r == " " or unicodedata.category(r)[0] in "LMNPS"


def ollama_parse(text: str) -> list[tuple[str, str]]:
    """parser.go ``ParseFile``: the commands of a Modelfile as Ollama reads them, ``(name, args)`` (``FROM`` is
    ``model``, a ``PARAMETER``'s name is the parameter's). Raises ValueError where Ollama reports an error."""
    nil, name, value, parameter, comment = range(5)
    commands: list[tuple[str, str]] = []
    cur, buf, cmd = nil, "", ""
    for r in text:
        space, newline = r in " \t", r in "\r\n"
        if cur == nil:
            nxt, r = (comment, "") if r == "#" else (nil, "") if space or newline else (name, r)
        elif cur == name:
            if not r.isascii() or not (r.isalpha() or space):
                raise ValueError("invalid command")
            nxt, r = (value, "") if space else (name, r)
        elif cur == value:
            nxt = nil if space or newline else value
        elif cur == parameter:
            if not (r.isascii() and (r.isalnum() or r == "_") or space):
                raise ValueError("unexpected EOF")
            nxt, r = (value, "") if space else (parameter, r)
        else:  # comment
            nxt, r = (nil, "") if newline else (comment, "")
        if nxt != cur:
            if cur == name:
                s = buf.lower()
                if s not in ("from", "license", "template", "system", "adapter", "renderer", "parser", "parameter",
                             "message", "requires"):
                    raise ValueError(f"invalid command {buf!r}")
                if s == "parameter":
                    nxt = parameter
                cmd = "model" if s == "from" else s
            elif cur == parameter:
                cmd = buf
            elif cur == value:
                args, ok = _unquote(buf.strip())
                if not ok or r in " \t":
                    buf += r
                    continue
                commands.append((cmd, args))
            buf, cur = "", nxt
        if r and _printable(r):
            buf += r
    if cur == value:
        args, ok = _unquote(buf.strip())
        if not ok:
            raise ValueError("unexpected EOF")
        commands.append((cmd, args))
    elif cur not in (nil, comment):
        raise ValueError("unexpected EOF")
    if not any(c == "model" for c, _ in commands):
        raise ValueError("no FROM line")
    return commands


def ollama_request(text: str) -> dict[str, Any]:
    """parser.go ``CreateRequest``, short: the files (``FROM`` paths, in order), the template and the parameters
    (``stop`` a list, the others their text)."""
    req: dict[str, Any] = {"from": [], "template": None, "parameters": {}}
    for cmd, args in ollama_parse(text):
        if cmd == "model":
            req["from"].append(args)
        elif cmd == "template":
            req["template"] = args
        elif cmd == "stop":
            req["parameters"].setdefault("stop", []).append(args)
        elif cmd not in ("system", "license", "adapter", "message"):
            req["parameters"][cmd] = args
    return req


def test_the_parser_port_reads_a_modelfile_as_ollama_does() -> None:
    """The port against Ollama's own example (docs/modelfile.mdx, ``ollama show --modelfile llama3.2``)."""
    example = ('# Modelfile generated by "ollama show"\n# To build a new Modelfile based on this one, replace the FROM '
               'line with:\n# FROM llama3.2:latest\nFROM /Users/pdevine/.ollama/models/blobs/sha256-00e1\n'
               'TEMPLATE """{{ if .System }}<|start_header_id|>system<|end_header_id|>\n\n{{ .System }}<|eot_id|>'
               '{{ end }}"""\nPARAMETER stop "<|start_header_id|>"\nPARAMETER stop "<|eot_id|>"\n'
               "PARAMETER temperature 1\nSYSTEM You are Mario from super mario bros, acting as an assistant.\n")
    assert ollama_parse(example) == [
        ("model", "/Users/pdevine/.ollama/models/blobs/sha256-00e1"),
        ("template", "{{ if .System }}<|start_header_id|>system<|end_header_id|>\n\n{{ .System }}<|eot_id|>{{ end }}"),
        ("stop", "<|start_header_id|>"), ("stop", "<|eot_id|>"), ("temperature", "1"),
        ("system", "You are Mario from super mario bros, acting as an assistant.")]
    with pytest.raises(ValueError, match="unexpected EOF"):
        ollama_parse('FROM x\nTEMPLATE """never closed\n')
    with pytest.raises(ValueError, match="no FROM line"):
        ollama_parse("PARAMETER stop x\n")


# ------------------------------------------------------------------ models with a real chat template


def chat_model(tmp_path: Path, fixture: str, template: str | None = None, *, generation: dict | None = None,
               added: dict[int, str] | None = None) -> Path:
    """A copy of fixture model ``fixture`` (its files linked) whose tokenizer_config.json holds the chat template
    file ``template`` (None: none), ``added`` tokens over ids of its vocabulary, and ``generation`` as its
    generation_config.json (None: the fixture's)."""
    src, dst = MODELS / fixture, tmp_path / f"{fixture}-chat"
    dst.mkdir()
    for f in src.iterdir():
        if f.name not in ("tokenizer_config.json", "reference") and not (generation is not None
                                                                         and f.name == "generation_config.json"):
            (dst / f.name).symlink_to(f)
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    if template is not None:
        cfg["chat_template"] = (CHAT_TEMPLATES / template).read_text()
    for tid, content in (added or {}).items():
        cfg.setdefault("added_tokens_decoder", {})[str(tid)] = {"content": content, "special": True}
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    if generation is not None:
        (dst / "generation_config.json").write_text(json.dumps(generation))
    return dst


def planned(src: Path, out: Path | str, **kw: Any) -> dict[str, Any]:
    """The Modelfile a ``--dry-run`` plans for ``src`` -> ``out`` (``--to gguf:q8_0 --modelfile``)."""
    r = convert(ConvertOptions(src=str(src), to=kw.pop("to", "gguf:q8_0"), output=str(out), dry_run=True,
                               modelfile=kw.pop("modelfile", "Modelfile"), **kw))
    return r.dry_run["modelfile"]


HEADER = ("# Ollama Modelfile for model.gguf, written by convert-bnb: ollama create NAME -f Modelfile\n"
          "FROM ./model.gguf\n")


def _stops(*stops: str) -> str:
    return "".join(f'PARAMETER stop "{s}"\n' for s in stops)


#: fixture, the real model's chat template, Ollama's template for it, the Modelfile's comment on it, and the
#: stop strings: the template's (Ollama's template/NAME.json), then the fixture's EOS (</s>).
FAMILIES = [
    ("llama_nf4_dq", "meta-llama-Llama-3.2-3B-Instruct.jinja", "llama3-instruct",
     "# TEMPLATE: Ollama's llama3-instruct template (its template/llama3-instruct.gotmpl) for the model's\n"
     "# Llama 3 chat template (the original's tool calls are not in it)\n",
     ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "</s>")),
    ("qwen2_moe_nf4_dq", "Qwen-Qwen2.5-7B-Instruct.jinja", "chatml",
     "# TEMPLATE: Ollama's chatml template (its template/chatml.gotmpl) for the model's ChatML chat\n"
     "# template (the original's tool calls are not in it)\n", ("<|im_start|>", "<|im_end|>", "</s>")),
    ("qwen3_nf4_dq", "Qwen-Qwen3-0.6B.jinja", "chatml",
     "# TEMPLATE: Ollama's chatml template (its template/chatml.gotmpl) for the model's ChatML chat\n"
     "# template (the original's tool calls and reasoning blocks are not in it)\n",
     ("<|im_start|>", "<|im_end|>", "</s>")),
    ("smollm3_nf4_dq", "HuggingFaceTB-SmolLM3-3B.jinja", "chatml",
     "# TEMPLATE: Ollama's chatml template (its template/chatml.gotmpl) for the model's ChatML chat\n"
     "# template (the original's reasoning blocks are not in it)\n", ("<|im_start|>", "<|im_end|>", "</s>")),
    ("mistral_hd_nf4_dq", "mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral-instruct",
     "# TEMPLATE: Ollama's mistral-instruct template (its template/mistral-instruct.gotmpl) for the\n"
     "# model's Mistral [INST] chat template (the original's tool calls are not in it)\n", ("</s>",)),
    ("gemma2_nf4_dq", "google-gemma-2-2b-it.jinja", "gemma-instruct",
     "# TEMPLATE: Ollama's gemma-instruct template (its template/gemma-instruct.gotmpl) for the model's\n"
     "# Gemma chat template\n", ("<start_of_turn>", "<end_of_turn>", "</s>")),
    ("gemma3_nf4_dq", "google-gemma-3-4b-it.jinja", "gemma3-instruct",
     "# TEMPLATE: Ollama's gemma3-instruct template (its template/gemma3-instruct.gotmpl) for the model's\n"
     "# Gemma 3 chat template\n", ("<end_of_turn>", "</s>")),
    ("phi3_nf4_dq", "microsoft-Phi-3.5-mini-instruct.jinja", "phi-3",
     "# TEMPLATE: Ollama's phi-3 template (its template/phi-3.gotmpl) for the model's Phi-3 chat template\n",
     ("<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "</s>")),
    ("cohere_nf4_dq", "CohereForAI-c4ai-command-r-v01-default.jinja", "command-r",
     "# TEMPLATE: Ollama's command-r template (its template/command-r.gotmpl) for the model's Command-R\n"
     "# chat template\n", ("<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>", "</s>")),
]


@pytest.mark.parametrize(("fixture", "jinja", "name", "comment", "stops"), FAMILIES, ids=[f[0] for f in FAMILIES])
def test_each_family_gets_ollamas_template(fixture: str, jinja: str, name: str, comment: str,
                                           stops: tuple[str, ...], tmp_path: Path) -> None:
    mf = planned(chat_model(tmp_path, fixture, jinja), tmp_path / "model.gguf")
    text = OLLAMA[name][0]
    assert mf["text"] == HEADER + comment + f'TEMPLATE """{text}"""\n' + _stops(*stops)
    assert mf["template"] == name
    left = comment.split("(the original's ")[1].split(" are not in it)")[0] if "original's" in comment else None
    assert mf["notes"] == [f"Modelfile: TEMPLATE is Ollama's {name} template, for the model's "
                           f"{TEMPLATES[name].family} chat template" + (f" (the original's {left} are not in it)"
                                                                          if left else "")]
    # what Ollama reads back: the GGUF, its own template byte for byte, the stop strings
    assert ollama_request(mf["text"]) == {"from": ["./model.gguf"], "template": text,
                                          "parameters": {"stop": list(stops)}}


def test_a_mistral_system_prompt_template_is_not_translated(tmp_path: Path) -> None:
    """Mistral Small 3.2's [SYSTEM_PROMPT] format: Ollama ships no template for it; no TEMPLATE, a comment, a note."""
    mf = planned(chat_model(tmp_path, "mistral3_nf4_dq", "Mistral-Small-3.2-24B-Instruct-2506.jinja"),
                 tmp_path / "model.gguf")
    assert mf["text"] == HEADER + (
        "# TEMPLATE: none, the chat template is not translated: a Mistral chat template with [SYSTEM_PROMPT]\n"
        "# (Mistral Small 3, Ministral 3, Devstral), for which Ollama ships no template; ollama create takes\n"
        "# its template closest to the GGUF's tokenizer.chat_template, or none (the prompt as it is) when\n"
        "# none is close. Add a TEMPLATE in Ollama's Go template syntax\n"
        "# (https://github.com/ollama/ollama/blob/main/docs/template.md) to chat with the model\n"
        'PARAMETER stop "</s>"\n')
    assert mf["template"] is None
    assert mf["notes"] == [
        "Modelfile: the chat template is not translated: a Mistral chat template with [SYSTEM_PROMPT] (Mistral "
        "Small 3, Ministral 3, Devstral), for which Ollama ships no template; no TEMPLATE line, so ollama create "
        "takes its template closest to the GGUF's tokenizer.chat_template, or none (the prompt as it is) when none "
        "is close"]
    assert ollama_request(mf["text"]) == {"from": ["./model.gguf"], "template": None,
                                          "parameters": {"stop": ["</s>"]}}


def test_a_model_without_a_chat_template_gets_no_template(tmp_path: Path) -> None:
    mf = planned(MODELS / "llama_nf4_dq", tmp_path / "model.gguf")
    assert mf["text"] == HEADER + (
        "# TEMPLATE: none, the chat template is not translated: the model has no chat template\n"
        "# (tokenizer_config.json chat_template, chat_template.jinja); Ollama sends the prompt as it is. Add\n"
        "# a TEMPLATE in Ollama's Go template syntax\n"
        "# (https://github.com/ollama/ollama/blob/main/docs/template.md) to chat with the model\n"
        'PARAMETER stop "</s>"\n')
    assert mf["notes"] == ["Modelfile: the chat template is not translated: the model has no chat template "
                           "(tokenizer_config.json chat_template, chat_template.jinja); no TEMPLATE line, so Ollama "
                           "sends the prompt as it is"]


@pytest.mark.parametrize(("jinja", "want", "reason"), [
    # Phi-4: ChatML's tokens with <|im_sep|> turns, another format
    ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '<|im_sep|>' + m['content'] + '<|im_end|>'}}{% endfor %}",
     None, "its special tokens are not those of a family Ollama ships a template for (Llama 3, ChatML, Llama 2, "
           "Mistral [INST], Gemma 3, Gemma, Phi-3, Command-R)"),
    ("{{ bos_token }}{% for m in messages %}{{ '[INST] <<SYS>>\\n' + m['content'] + ' [/INST]' }}{% endfor %}",
     "llama2-chat", ""),
    ("{{ '[INST] ' + messages[0]['content'] + ' [/INST]' }}", "mistral-instruct", ""),
    ("{{ '<|im_start|>user\\n' }}{{ '<|start_header_id|>' }}{{ '<|im_end|><|eot_id|>' }}", None,
     "it holds the markers of several families (Llama 3, ChatML)"),
    ("{% for m in messages %}### Instruction:\n{{ m['content'] }}\n### Response:\n{% endfor %}", None,
     "its special tokens are not those of a family Ollama ships a template for (Llama 3, ChatML, Llama 2, "
     "Mistral [INST], Gemma 3, Gemma, Phi-3, Command-R)"),
    ("   \n", None, "the model has no chat template (tokenizer_config.json chat_template, chat_template.jinja)"),
])
def test_recognise(jinja: str, want: str | None, reason: str) -> None:
    found = recognise(jinja)
    assert (found.template.name if found.template else None, found.reason) == (want, reason)


def test_stop_tokens_come_from_the_template_the_eos_and_generation_config(tmp_path: Path) -> None:
    """The template's stop strings, the GGUF's EOS, generation_config.json's eos_token_id list, each once; a token
    that a Modelfile value cannot hold (a '"') is left out with a note. Sampling values as Ollama names them;
    mirostat (deprecated in Ollama) left out with a note."""
    gen = {"eos_token_id": [2, 5, 6, 7], "temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.0,
           "repetition_penalty": 1.05, "mirostat": 2}
    src = chat_model(tmp_path, "qwen3_nf4_dq", "Qwen-Qwen3-0.6B.jinja", generation=gen,
                     added={5: "<|im_end|>", 6: '<q"x>', 7: "<|endoftext|>"})
    mf = planned(src, tmp_path / "model.gguf")
    assert mf["text"] == HEADER + (
        "# TEMPLATE: Ollama's chatml template (its template/chatml.gotmpl) for the model's ChatML chat\n"
        "# template (the original's tool calls and reasoning blocks are not in it)\n"
        f'TEMPLATE """{OLLAMA_CHATML}"""\n'
        + _stops("<|im_start|>", "<|im_end|>", "</s>", "<|endoftext|>")
        + "PARAMETER temperature 0.6\nPARAMETER top_k 20\nPARAMETER top_p 0.95\nPARAMETER min_p 0.0\n"
        "PARAMETER repeat_penalty 1.05\n")
    assert mf["notes"][1:] == [
        "Modelfile: stop token(s) '<q\"x>' left out (a Modelfile cannot hold '\"' or characters that are not "
        "printable in a value)",
        "Modelfile: general.sampling.mirostat left out (Ollama has no such parameter)"]
    assert ollama_request(mf["text"])["parameters"] == {
        "stop": ["<|im_start|>", "<|im_end|>", "</s>", "<|endoftext|>"], "temperature": "0.6", "top_k": "20",
        "top_p": "0.95", "min_p": "0.0", "repeat_penalty": "1.05"}


def test_make_modelfile_names_parts_projector_and_paths_relative_to_the_modelfile(tmp_path: Path) -> None:
    meta = {"tokenizer.ggml.tokens": ([b"<unk>", b"<s>", "</s>"], None, None),
            "tokenizer.ggml.eos_token_id": (2, None, None), "general.sampling.temp": (1, None, None)}
    parts = [tmp_path / "out" / f"m b-0000{i}-of-00002.gguf" for i in (1, 2)]
    mf = make_modelfile(meta, tmp_path / "out" / "Modelfile", parts, tmp_path / "vision" / "mmproj.gguf")
    assert mf.text.splitlines()[1:] == [
        "# the 2 parts of the split GGUF (Ollama merges them when it imports the model)",
        'FROM "./m b-00001-of-00002.gguf"', 'FROM "./m b-00002-of-00002.gguf"',
        "# the vision projector (ollama create keeps a GGUF of general.type mmproj as the projector)",
        "FROM ../vision/mmproj.gguf",
        "# TEMPLATE: none, the chat template is not translated: the model has no chat template",
        "# (tokenizer_config.json chat_template, chat_template.jinja); Ollama sends the prompt as it is. Add",
        "# a TEMPLATE in Ollama's Go template syntax",
        "# (https://github.com/ollama/ollama/blob/main/docs/template.md) to chat with the model",
        'PARAMETER stop "</s>"', "PARAMETER temperature 1"]
    assert ollama_request(mf.text)["from"] == ["./m b-00001-of-00002.gguf", "./m b-00002-of-00002.gguf",
                                               "../vision/mmproj.gguf"]
    with pytest.raises(E.UsageError) as info:
        make_modelfile(meta, tmp_path / "Modelfile", [tmp_path / 'a"b.gguf'])
    assert "USE-001 --modelfile: a GGUF file name with '\"'" in str(info.value)


# ------------------------------------------------------------------ written with the GGUF


def test_written_beside_the_gguf_after_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = chat_model(tmp_path, "qwen3_nf4_dq", "Qwen-Qwen3-0.6B.jinja")
    out = tmp_path / "out"
    assert main([str(src), "--to", "gguf:q8_0", "-o", f"{out}/", "--modelfile"]) == 0
    err = capsys.readouterr().err
    (gguf_file,) = out.glob("*.gguf")
    assert sorted(p.name for p in out.iterdir()) == sorted([gguf_file.name, "Modelfile"])
    text = (out / "Modelfile").read_text()
    assert text == planned(src, f"{out}/", overwrite=True)["text"]
    assert ollama_request(text)["from"] == [f"./{gguf_file.name}"]
    assert (f"note: Modelfile: {out / 'Modelfile'} ({len(text)} B)\nnote: Modelfile: TEMPLATE is Ollama's chatml "
            "template, for the model's ChatML chat template") in err
    r = convert(ConvertOptions(src=str(src), to="gguf:q8_0", output=f"{out}/", modelfile="Modelfile", overwrite=True,
                               list_files=True))
    assert r.details["modelfile"] == {"output": str(out / "Modelfile"), "template": "chatml", "bytes_out": len(text),
                                      "verified": True, "files": {"Modelfile": {
                                          "bytes": len(text), "sha256": sha256_file(out / "Modelfile")}}}


def test_an_existing_modelfile_is_refused_before_anything_is_written(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "model.gguf"
    (tmp_path / "Modelfile").write_text("mine")
    assert main([str(MODELS / "llama_nf4_dq"), "--to", "gguf", "-o", str(out), "--modelfile", "-q"]) == 2
    err = capsys.readouterr().err
    assert f"'{tmp_path / 'Modelfile'}': OUT-001 output exists" in err and "--overwrite" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["Modelfile"]
    assert (tmp_path / "Modelfile").read_text() == "mine"
    assert main([str(MODELS / "llama_nf4_dq"), "--to", "gguf", "-o", str(out), "--modelfile", "--overwrite", "-q"]) == 0
    assert (tmp_path / "Modelfile").read_text().startswith("# Ollama Modelfile for model.gguf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["Modelfile", "model.gguf"]


@pytest.mark.parametrize(("argv", "parts"), [
    (["--to", "bf16", "--modelfile"], ["USE-001 --modelfile needs --to gguf[:TYPE]", "found '--to bf16'"]),
    (["--to", "gguf", "-o", "{tmp}/Modelfile", "--modelfile"], ["USE-001 --modelfile names another output of the run"]),
])
def test_refusals_write_nothing(argv: list[str], parts: list[str], tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    args = [a.format(tmp=tmp_path) for a in argv]
    if "-o" not in args:
        args += ["-o", str(tmp_path / "out")]
    assert main([str(MODELS / "llama_nf4_dq"), *args, "-q"]) == 2
    err = capsys.readouterr().err
    for part in parts:
        assert part in err, (part, err)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_directory_in_the_modelfiles_place_is_refused_before_the_gguf(tmp_path: Path, overwrite: bool,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """USE-003 before anything is written (the GGUF is not committed), with --overwrite too: a Modelfile never
    replaces a directory."""
    out = tmp_path / "u4"
    (out / "Modelfile").mkdir(parents=True)
    argv = [str(MODELS / "llama_nf4_dq"), "--to", "gguf:q4_k_m", "-o", f"{out}/", "--modelfile", "-q"]
    assert main(argv + (["--overwrite"] if overwrite else [])) == 2
    err = capsys.readouterr().err
    assert f"'{out / 'Modelfile'}': USE-003 --modelfile names an existing path that is not a file" in err
    assert "(expected 'a file', found 'a directory')" in err
    assert [p.name for p in out.iterdir()] == ["Modelfile"] and list((out / "Modelfile").iterdir()) == []
    with pytest.raises(E.OutputKindError):
        convert(ConvertOptions(src=str(MODELS / "llama_nf4_dq"), to="gguf", output=str(out / "m.gguf"),
                               modelfile="Modelfile", dry_run=True))


def test_modelfile_with_an_adapter_as_src_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A GGUF LoRA adapter gets no Modelfile (Ollama's ADAPTER line goes in the base's): USE-001, as --mmproj."""
    argv = [str(FIXTURES / "lora" / "adapter"), "--to", "gguf", "--base", str(MODELS / "llama_orig_bf16"), "-o",
            str(tmp_path / "a.gguf"), "--modelfile"]
    assert main(argv) == 2
    assert "USE-001 --modelfile does not apply to a LoRA adapter as SRC (found '--modelfile')" in \
        capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_bad_modelfile_name_is_refused(tmp_path: Path) -> None:
    for name in ("", "..", "a/b", ".hidden"):
        with pytest.raises(E.UsageError) as info:
            convert(ConvertOptions(src=str(MODELS / "llama_nf4_dq"), to="gguf", output=str(tmp_path / "m.gguf"),
                                   modelfile=name))
        assert "USE-001 the Modelfile's name must be a plain file name" in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_dry_run_shows_it_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = chat_model(tmp_path, "gemma2_nf4_dq", "google-gemma-2-2b-it.jinja")
    out = tmp_path / "out"
    assert main([str(src), "--to", "gguf:q4_0", "-o", str(out / "g.gguf"), "--modelfile", "--dry-run"]) == 0
    text = capsys.readouterr().out
    body = "".join(f"  | {line}\n" for line in planned(src, out / "g.gguf", to="gguf:q4_0")["text"].splitlines())
    assert f"Modelfile {out / 'Modelfile'}: " in text and "bytes, TEMPLATE Ollama's gemma-instruct\n" in text
    assert body in text
    assert not out.exists()
    assert main([str(src), "--to", "gguf:q4_0", "-o", str(out / "g.gguf"), "--modelfile", "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["modelfile"]
    assert (plan["output"], plan["template"], plan["exists"]) == (str(out / "Modelfile"), "gemma-instruct", False)
    out.mkdir()
    (out / "Modelfile").write_text("mine")
    assert main([str(src), "--to", "gguf:q4_0", "-o", str(out / "g.gguf"), "--modelfile", "--dry-run"]) == 0
    assert "\n  Modelfile exists: --overwrite needed\n" in capsys.readouterr().out
    assert [p.name for p in out.iterdir()] == ["Modelfile"] and (out / "Modelfile").read_text() == "mine"


def test_a_split_gguf_names_every_part(tmp_path: Path) -> None:
    src = chat_model(tmp_path, "llama_nf4_dq", "meta-llama-Llama-3.2-3B-Instruct.jinja")
    out = tmp_path / "out"
    r = convert(ConvertOptions(src=str(src), to="gguf:q8_0", output=str(out / "m.gguf"), split_max_tensors=10,
                               modelfile="Modelfile"))
    parts = sorted(p.name for p in out.glob("m-*.gguf"))
    assert len(parts) > 1 and r.output == str(out / parts[0])
    assert ollama_request((out / "Modelfile").read_text())["from"] == [f"./{p}" for p in parts]


def test_the_vision_projector_is_a_second_from_line(tmp_path: Path) -> None:
    out = tmp_path / "out"
    convert(ConvertOptions(src=str(MODELS / "gemma3cg_nf4_dq"), to="gguf:q8_0", output=str(out / "g.gguf"),
                           mmproj=str(out / "mmproj-g.gguf"), modelfile="Modelfile"))
    assert sorted(p.name for p in out.iterdir()) == ["Modelfile", "g.gguf", "mmproj-g.gguf"]
    text = (out / "Modelfile").read_text()
    assert ollama_request(text)["from"] == ["./g.gguf", "./mmproj-g.gguf"]
    assert "# the vision projector (ollama create keeps a GGUF of general.type mmproj as the projector)\n" in text


# ------------------------------------------------------------------ batch


def _batch(jobs: Path, out: Path, env: dict[str, str], *extra: str):  # noqa: ANN202
    return run_cli(["batch", str(jobs), "--out-dir", str(out), "--max-memory", "256MiB", *extra], env)


def test_batch_writes_a_modelfile_beside_each_gguf(tmp_path: Path) -> None:
    src = chat_model(tmp_path, "qwen3_nf4_dq", "Qwen-Qwen3-0.6B.jinja")
    jobs = tmp_path / "jobs.txt"
    jobs.write_text(f"{src} --to gguf:q8_0 --name a --modelfile\n{src} --to gguf:f16 --name b --modelfile b.mf\n"
                    f"{MODELS / 'llama_nf4_dq'} --to gguf --name c\n")
    out, env = tmp_path / "out", offline_env(tmp_path)
    r = _batch(jobs, out, env, "--json")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == [".convert-bnb", "a.Modelfile", "a.gguf", "b.gguf", "b.mf",
                                                     "c.gguf"]
    for name, mf in (("a.gguf", "a.Modelfile"), ("b.gguf", "b.mf")):
        text = (out / mf).read_text()
        assert text == planned(src, out / name, to="gguf:q8_0" if name == "a.gguf" else "gguf:f16",
                               modelfile=mf, overwrite=True)["text"]
        assert ollama_request(text)["from"] == [f"./{name}"]
        state = json.loads((out / ".convert-bnb" / f"{name}.json").read_text())
        assert state["modelfile_files"] == {mf: {"bytes": len(text), "sha256": sha256_file(out / mf)}}
        assert state["key"]["modelfile"] == mf
    assert "modelfile_files" not in json.loads((out / ".convert-bnb" / "c.gguf.json").read_text())
    r = _batch(jobs, out, env, "--json")
    assert [j["status"] for j in json.loads(r.stdout)] == ["skipped"] * 3
    # the dry run's upload plan pushes it with the GGUF, and the card names it
    r = _batch(jobs, out, env, "--push-to-hub", "me", "--dry-run", "--json")
    plan = json.loads(r.stdout)[0]
    ops = {o["path_in_repo"]: o["from"] for o in plan["upload"]["commit"]["operations"]}
    assert ops == {"a.gguf": str(out / "a.gguf"), "a.Modelfile": str(out / "a.Modelfile"), "README.md": "model card"}
    assert "| --modelfile | a.Modelfile |" in plan["card"] and " --modelfile\n" in plan["card"]


def test_batch_modelfile_needs_a_gguf_job(tmp_path: Path) -> None:
    from convert.batch.jobs import parse_jobs

    jobs = tmp_path / "jobs.txt"
    for line, part in ((f"{MODELS / 'llama_nf4_dq'} --to bf16 --modelfile", "--modelfile needs a GGUF target"),
                       (f"{MODELS / 'llama_nf4_dq'} --to gguf --modelfile .mf", "modelfile must be true or a plain")):
        jobs.write_text(line + "\n")
        with pytest.raises(E.BatchOptionError) as info:
            parse_jobs(jobs, type("D", (), {"to": "auto", "max_shard_size": 5 * 10**9})())
        assert info.value.rule == "BATCH-003" and part in str(info.value)


def test_batch_pushes_the_modelfile_with_the_gguf(tmp_path: Path) -> None:
    from tests.helpers.fakehub import FakeHub, push_env

    src = chat_model(tmp_path, "phi3_nf4_dq", "microsoft-Phi-3.5-mini-instruct.jinja")
    jobs = tmp_path / "jobs.txt"
    jobs.write_text(f"{src} --to gguf:q8_0 --name p --modelfile\n")
    hub = FakeHub()
    url = hub.start()
    try:
        env = push_env(offline_env(tmp_path, tmp_path / "hub"), url)
        out = tmp_path / "out"
        r = _batch(jobs, out, env, "--push-to-hub", "me", "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)[0]["pushed"] == "me/p"
        repo = hub.repos["me/p"]
        pushed = repo["commits"][repo["refs"]["main"]]
        assert sorted(pushed) == ["README.md", "p.Modelfile", "p.gguf"]
        assert pushed["p.Modelfile"] == (out / "p.Modelfile").read_bytes()
        assert ollama_request(pushed["p.Modelfile"].decode())["template"] == OLLAMA_PHI_3
    finally:
        hub.stop()


def test_no_ollama_binary_here() -> None:
    """Where an ``ollama`` binary is installed, ``ollama create`` would be the check; none is here (the parser port
    above stands in for it). This test fails when one appears, so that the check gets written."""
    assert not any(os.access(os.path.join(d, "ollama"), os.X_OK) for d in os.environ.get("PATH", "").split(os.pathsep))
