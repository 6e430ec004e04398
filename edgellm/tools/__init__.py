"""Tool calling: tool definitions and tool_choice checked and turned into prompts and grammars
(spec), and the output parsers that turn a model's text into OpenAI tool calls as it streams
(parsers)."""
