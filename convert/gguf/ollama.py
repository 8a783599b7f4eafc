"""Ollama's own chat templates, and which of them a model's Jinja chat template is.

Ollama does not run Jinja: a model's prompt format is a Go ``text/template`` (``TEMPLATE`` in a Modelfile). When a
Modelfile gives none, ``ollama create`` compares the GGUF's ``tokenizer.chat_template`` with the Jinja templates it
knows (its ``template/index.json``) and takes the Go template of the closest one when the Levenshtein distance is
below 100 (``template.Named``, ``server/create.go`` ``detectChatTemplate``); else the model gets ``{{ .Prompt }}``:
the prompt without any chat formatting. A long modern template (tools, reasoning) is never that close, so the
Modelfile says which template to use.

:data:`TEMPLATES` holds the Go templates Ollama ships for the families recognised here, byte for byte as in
``github.com/ollama/ollama`` ``template/NAME.gotmpl``, with the stop strings of its ``template/NAME.json`` (the
commit each was read at and the sha256 of its text are in the table; ``mistral-instruct`` has no ``.json``).
:func:`recognise` names the family of a Jinja template from the special tokens and markers its text holds, as
unsloth's ``ollama_template_mappers.py`` maps a family to Ollama's template (unsloth goes by the model's name).

What is recognised (special tokens and markers in the Jinja text), each mapped to the template of that name:

=================  ==========================================================  ===========================
family             markers                                                     Ollama template
=================  ==========================================================  ===========================
Llama 3            ``<|start_header_id|>`` and ``<|eot_id|>``                  ``llama3-instruct``
ChatML             ``<|im_start|>`` and ``<|im_end|>``, no ``<|im_sep|>``      ``chatml``
                   (Qwen 2/2.5/3, SmolLM3, Hermes; Phi-4's ``<|im_sep|>``
                   turns are another format)
Llama 2            ``[INST]`` and ``<<SYS>>``                                  ``llama2-chat``
Mistral            ``[INST]`` and ``[/INST]``, neither ``<<SYS>>`` nor         ``mistral-instruct``
                   ``[SYSTEM_PROMPT]``
Gemma 3            ``<start_of_turn>``, ``<end_of_turn>`` and                  ``gemma3-instruct``
                   ``first_user_prefix`` (a system message put before the
                   first user turn)
Gemma 1/2          ``<start_of_turn>`` and ``<end_of_turn>``                   ``gemma-instruct``
Phi-3              ``<|user|>``, ``<|assistant|>`` and ``<|end|>``             ``phi-3``
Command-R          ``<|START_OF_TURN_TOKEN|>`` and ``<|CHATBOT_TOKEN|>``       ``command-r``
=================  ==========================================================  ===========================

A template matching none (or more than one) of them is not translated: :func:`recognise` says why (Mistral's
``[SYSTEM_PROMPT]`` format of Mistral Small 3 / Ministral 3 / Devstral has no template in Ollama's set).
Ollama's templates carry the turns (system, user, assistant; Command-R's also tools); what else a model's
own Jinja does (tool calls, reasoning blocks, a default system prompt) is not in them, and
:attr:`Recognised.left_out` says which of these the original had.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TEMPLATES", "OllamaTemplate", "Recognised", "recognise"]


@dataclass(frozen=True)
class OllamaTemplate:
    """One of Ollama's chat templates.

    Attributes:
        name: its name in Ollama (``template/NAME.gotmpl``).
        family: the model family it is for, in messages.
        text: the Go template, as Ollama's file holds it.
        stop: the stop strings of its ``template/NAME.json`` (empty when Ollama ships none).
        commit: the ``github.com/ollama/ollama`` commit the text was read at.
        sha256: the sha256 of ``text`` (UTF-8), to compare with Ollama's file.
    """

    name: str
    family: str
    text: str
    stop: tuple[str, ...]
    commit: str
    sha256: str


# ---------------------------------------------------------------- Ollama's templates (template/NAME.gotmpl)

_CHATML = (
    "{{- range .Messages }}<|im_start|>{{ .Role }}\n"
    "{{ .Content }}<|im_end|>\n"
    "{{ end }}<|im_start|>assistant\n"
)

_LLAMA3_INSTRUCT = (
    "{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n"
    "\n"
    "{{ .Content }}<|eot_id|>\n"
    "{{- end }}<|start_header_id|>assistant<|end_header_id|>\n"
    "\n"
)

_MISTRAL_INSTRUCT = (
    "[INST] {{ range $index, $_ := .Messages }}\n"
    "{{- if eq .Role \"system\" }}{{ .Content }}\n"
    "\n"
    "{{ else if eq .Role \"user\" }}{{ .Content }}[/INST]\n"
    "{{- else if eq .Role \"assistant\" }} {{ .Content }}</s>[INST] {{ end }}\n"
    "{{- end }}"
)

_LLAMA2_CHAT = (
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

_GEMMA_INSTRUCT = (
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

_GEMMA3_INSTRUCT = (
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

_PHI_3 = (
    "{{- range .Messages }}<|{{ .Role }}|>\n"
    "{{ .Content }}<|end|>\n"
    "{{ end }}<|assistant|>\n"
)

_COMMAND_R = (
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

#: Ollama's templates for the families :func:`recognise` knows, by name. Each text is Ollama's
#: ``template/NAME.gotmpl`` at ``commit`` (sha256 of the text beside it); the stop strings are its
#: ``template/NAME.json``'s: chatml.json at e1e0d59a, llama3-instruct.json at 75d1b796, llama2-chat.json at
#: f4d852dc, gemma-instruct.json at b94e7ece, gemma3-instruct.json at 11a3c733 (its ``temperature`` 0.1 is not
#: taken: Ollama's own template detection reads only ``stop``), phi-3.json at 41f885f2, command-r.json at f7cc50a7.
TEMPLATES: dict[str, OllamaTemplate] = {t.name: t for t in (
    OllamaTemplate("llama3-instruct", "Llama 3", _LLAMA3_INSTRUCT,
                   ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
                   "888b6fbb5a1ab1d84ef790e2d38ced189b32b027",
                   "61dc7b1a77154f4015bbf548fb63b33550162cfd5d6cbf59b7e7843ece99a49e"),
    OllamaTemplate("chatml", "ChatML", _CHATML, ("<|im_start|>", "<|im_end|>"),
                   "9fbfa74219fa74d030c816cc99d3bee0d1c1923d",
                   "e3b2721cec511e3a627ae0993753abbf5c72cdf4cfcdbc8f5c33ce15c4c4e04b"),
    OllamaTemplate("llama2-chat", "Llama 2", _LLAMA2_CHAT, ("[INST]", "[/INST]", "<<SYS>>", "<</SYS>>"),
                   "888b6fbb5a1ab1d84ef790e2d38ced189b32b027",
                   "3f74e056f96c687f67c49ed8309407e0612611e94b910464d8a3d9b60b46d7a6"),
    OllamaTemplate("mistral-instruct", "Mistral [INST]", _MISTRAL_INSTRUCT, (),
                   "75d1b79659f6b4e5459f8908b394f1cb75e878ef",
                   "c502cd9313888317b670db1c6d5698783656a22ea75101651baa2c94d42397fb"),
    OllamaTemplate("gemma3-instruct", "Gemma 3", _GEMMA3_INSTRUCT, ("<end_of_turn>",),
                   "a10ddf2577f8addefdbf352c5cfe5712ecb72388",
                   "680a6206c5762f5a0915d25b2e5d85f8a1aecbc07a03a504bcbe21b5796b34ca"),
    OllamaTemplate("gemma-instruct", "Gemma", _GEMMA_INSTRUCT, ("<start_of_turn>", "<end_of_turn>"),
                   "41f885f20344177b5f9ce128f21006b166e3d9a2",
                   "4ea0df93422f8340a23cbb30feb814196a03aed2e1d97382b6529fad7c541f79"),
    OllamaTemplate("phi-3", "Phi-3", _PHI_3, ("<|end|>", "<|system|>", "<|user|>", "<|assistant|>"),
                   "c3b52859c84826a9a98139203acb99bd1c316efe",
                   "35360843d0c84fb1506952a131bbef13cd2bb4a541251f22535170c05b56e672"),
    OllamaTemplate("command-r", "Command-R", _COMMAND_R, ("<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>"),
                   "f7cc50a7e64c6fc9e68b1bad96027de2f2c69505",
                   "cedc23829af01ffb7ac6cc9e79b07ac5f306bf37e11bddb93ec072dd4f8fc756"),
)}


def _markers(jinja: str) -> dict[str, bool]:
    """Which of :data:`TEMPLATES` the markers in ``jinja`` point to (see the module docstring's table)."""
    def has(*tokens: str) -> bool:
        return all(t in jinja for t in tokens)

    inst = has("[INST]")
    gemma = has("<start_of_turn>", "<end_of_turn>")
    return {
        "llama3-instruct": has("<|start_header_id|>", "<|eot_id|>"),
        "chatml": has("<|im_start|>", "<|im_end|>") and "<|im_sep|>" not in jinja,
        "llama2-chat": inst and has("<<SYS>>"),
        "mistral-instruct": inst and has("[/INST]") and not has("<<SYS>>") and not has("[SYSTEM_PROMPT]"),
        "gemma3-instruct": gemma and has("first_user_prefix"),
        "gemma-instruct": gemma and not has("first_user_prefix"),
        "phi-3": has("<|user|>", "<|assistant|>", "<|end|>"),
        "command-r": has("<|START_OF_TURN_TOKEN|>", "<|CHATBOT_TOKEN|>"),
    }


@dataclass(frozen=True)
class Recognised:
    """What :func:`recognise` found.

    Attributes:
        template: Ollama's template for the chat template's family, or None (not translated).
        reason: with ``template`` None: why, in a few words (for the Modelfile's comment and the run's note).
        left_out: what the original Jinja does that Ollama's template does not: ``tool calls``, ``reasoning
            blocks`` (``<think>``).
    """

    template: OllamaTemplate | None
    reason: str = ""
    left_out: tuple[str, ...] = ()


def recognise(jinja: str | None) -> Recognised:
    """The Ollama template for a model's Jinja chat template (its ``tokenizer.chat_template``), from the family
    markers its text holds (the module docstring's table).

    Args:
        jinja: the chat template's text, or None (the model has none).

    Returns:
        :class:`Recognised`: the template, or None with the reason (no chat template; Mistral's
        ``[SYSTEM_PROMPT]`` format; markers of no family, or of several).
    """
    if not jinja or not jinja.strip():
        return Recognised(None, "the model has no chat template (tokenizer_config.json chat_template, "
                                "chat_template.jinja)")
    found = [name for name, hit in _markers(jinja).items() if hit]
    if not found:
        if "[SYSTEM_PROMPT]" in jinja:
            return Recognised(None, "a Mistral chat template with [SYSTEM_PROMPT] (Mistral Small 3, Ministral 3, "
                                    "Devstral), for which Ollama ships no template")
        return Recognised(None, "its special tokens are not those of a family Ollama ships a template for ("
                          + ", ".join(t.family for t in TEMPLATES.values()) + ")")
    if len(found) > 1:
        return Recognised(None, "it holds the markers of several families ("
                          + ", ".join(TEMPLATES[n].family for n in found) + ")")
    template = TEMPLATES[found[0]]
    left_out = []
    if "tools" in jinja and template.name != "command-r":
        left_out.append("tool calls")
    if "<think>" in jinja:
        left_out.append("reasoning blocks")
    return Recognised(template, left_out=tuple(left_out))
