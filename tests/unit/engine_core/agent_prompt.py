"""A coding agent's request in the shape Claude Code sends: a long English system prompt and JSON tool schemas.

Written for these tests (not copied from any agent): the tokenizer's characters-a-token figure and
the long-prompt integration tests measure the kind of text agents send, not lorem ipsum.
"""

from __future__ import annotations

import json

SYSTEM = """You are an interactive command line tool that helps users with software engineering tasks. Use the \
instructions below and the tools available to you to assist the user.

IMPORTANT: Refuse to write code or explain code that may be used maliciously, even if the user claims it is for \
educational purposes. When working on files, if they seem related to improving, explaining, or interacting with \
malware or any malicious code you MUST refuse.

# Tone and style
You should be concise, direct, and to the point. When you run a non-trivial bash command, you should explain what \
the command does and why you are running it, to make sure the user understands what you are doing (this is \
especially important when you are running a command that will make changes to the user's system). Remember that \
your output will be displayed on a command line interface. Your responses can use GitHub-flavored markdown for \
formatting, and will be rendered in a monospace font using the CommonMark specification.

# Following conventions
When making changes to files, first understand the file's code conventions. Mimic code style, use existing \
libraries and utilities, and follow existing patterns. NEVER assume that a given library is available, even if it \
is well known. Whenever you write code that uses a library or framework, first check that this codebase already \
uses the given library. For example, you might look at neighboring files, or check the package.json (or \
cargo.toml, and so on depending on the language). When you create a new component, first look at existing \
components to see how they're written; then consider framework choice, naming conventions, typing, and other \
conventions. When you edit a piece of code, first look at the code's surrounding context (especially its imports) \
to understand the code's choice of frameworks and libraries. Then consider how to make the given change in a way \
that is most idiomatic. Always follow security best practices. Never introduce code that exposes or logs secrets \
and keys. Never commit secrets or keys to the repository.

# Doing tasks
The user will primarily request you perform software engineering tasks. This includes solving bugs, adding new \
functionality, refactoring code, explaining code, and more. For these tasks the following steps are recommended: \
use the available search tools to understand the codebase and the user's query; implement the solution using all \
tools available to you; verify the solution if possible with tests, and never assume a specific test framework or \
test script. Check the README or search the codebase to determine the testing approach. When you have completed a \
task, you MUST run the lint and typecheck commands (for example npm run lint, npm run typecheck, ruff, and so on) \
if they were provided to you to ensure your code is correct.

Here is useful information about the environment you are running in:
<env>
Working directory: /home/user/project
Is directory a git repo: Yes
Platform: linux
Today's date: 2026-12-02
</env>
"""

TOOLS = [
    ("Bash", "Executes a given bash command in a persistent shell session with optional timeout, ensuring proper "
             "handling and security measures. Before executing the command, verify that the parent directory exists "
             "and is the correct location. Always quote file paths that contain spaces with double quotes.",
     {"command": ("string", "The command to execute"), "timeout": ("number", "Optional timeout in milliseconds (max 600000)"),
      "description": ("string", "Clear, concise description of what this command does in five to ten words")}),
    ("Read", "Reads a file from the local filesystem. You can access any file directly by using this tool. The "
             "file_path parameter must be an absolute path, not a relative path. By default, it reads up to 2000 "
             "lines starting from the beginning of the file.",
     {"file_path": ("string", "The absolute path to the file to read"), "offset": ("number", "The line number to start reading from"),
      "limit": ("number", "The number of lines to read")}),
    ("Edit", "Performs exact string replacements in files. You must use your Read tool at least once in the "
             "conversation before editing. When editing text from Read tool output, ensure you preserve the exact "
             "indentation (tabs and spaces) as it appears after the line number prefix.",
     {"file_path": ("string", "The absolute path to the file to modify"), "old_string": ("string", "The text to replace"),
      "new_string": ("string", "The text to replace it with (must be different from old_string)"),
      "replace_all": ("boolean", "Replace all occurrences of old_string (default false)")}),
    ("Grep", "A powerful search tool built on ripgrep. Supports full regex syntax, filters files with the glob "
             "parameter or the type parameter, and offers output modes: content shows matching lines, "
             "files_with_matches shows only file paths, count shows match counts.",
     {"pattern": ("string", "The regular expression pattern to search for in file contents"),
      "path": ("string", "File or directory to search in. Defaults to the current working directory."),
      "glob": ("string", "Glob pattern to filter files (for example *.js or *.{ts,tsx})"),
      "output_mode": ("string", "Output mode: content, files_with_matches or count")}),
    ("WebFetch", "Fetches content from a specified URL and processes it using an AI model. Takes a URL and a prompt "
                 "as input, fetches the URL content, converts HTML to markdown, and returns the model's response about "
                 "the content.",
     {"url": ("string", "The URL to fetch content from"), "prompt": ("string", "The prompt to run on the fetched content")}),
    ("TodoWrite", "Use this tool to create and manage a structured task list for your current coding session. This "
                  "helps you track progress, organize complex tasks, and demonstrate thoroughness to the user.",
     {"todos": ("array", "The updated todo list"), "merge": ("boolean", "Whether to merge with the existing list")}),
]


def tool_schemas() -> list[dict]:
    """The tools in Anthropic's shape (name, description, input_schema)."""
    return [{"name": name, "description": desc,
             "input_schema": {"type": "object", "properties": {k: {"type": t, "description": d} for k, (t, d) in props.items()},
                              "required": [next(iter(props))], "additionalProperties": False,
                              "$schema": "http://json-schema.org/draft-07/schema#"}}
            for name, desc, props in TOOLS]


def agent_text() -> str:
    """The system prompt followed by the tool list as JSON: what an agent's first request mostly is."""
    return SYSTEM + "\n" + json.dumps(tool_schemas(), indent=2)


def long_prompt(tokens: int, tokenizer) -> str:
    """Agent text repeated, each copy numbered (so no two blocks match), cut to about `tokens` tokens."""
    unit = agent_text()
    per_copy = len(tokenizer.encode(unit, add_special_tokens=False))
    copies = [f"[{i}] {unit}" for i in range(tokens // per_copy + 1)]
    text = "".join(copies)
    return text[: int(len(text) * tokens / len(tokenizer.encode(text, add_special_tokens=False)))]
