"""Adapters that hand hutch's sandboxes and memory to agent frameworks, in the shapes each one expects.

    hutch.integrations.langchain    LangChain tools: hutch_run_code, hutch_exec, hutch_files, hutch_memory_search,
                                    hutch_memory_write             (pip install 'hutch[langchain]')
    hutch.integrations.langgraph    HutchStore: a LangGraph BaseStore kept as SMF files and git ('hutch[langchain]')
    hutch.integrations.llamaindex   HutchToolSpec (a code-interpreter tool spec), HutchRetriever ('hutch[llamaindex]')
    hutch.integrations.anthropic    Claude's client-side tools served by hutch: memory, bash, text editor;
                                    handle(response, sandbox=, memory=) ('hutch[anthropic]')
    hutch.integrations.openai       Agents SDK function tools, and handle() for Responses / Chat Completions
                                    tool calls ('hutch[openai]')
    hutch.integrations.openai_sandbox  HutchSandboxClient: hutch as the Agents SDK's SandboxAgent backend
    hutch.integrations.smolagents   HutchExecutor: a CodeAgent's code runs in a hutch sandbox ('hutch[smolagents]')

Each adapter is a thin shell over `_common.Toolbox`, which does the work with hutch's public API only.
A tool never raises on what a model sends: bad input, a path that escapes, a payload past its bound and
any hutch error come back as a tool error whose text names the fix. See docs/integrations.md.
"""
