"""Tool calling: tool definitions and tool_choice checked and turned into prompts and grammars
(spec), and the output parsers that turn a model's text into OpenAI tool calls as it streams
(parsers, parser_llama3, parser_mistral, parser_pythonic; chosen per model in families)."""
