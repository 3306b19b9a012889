"""A smolagents executor whose code runs in a hutch sandbox: a CodeAgent's actions run there, not locally.

    from smolagents import CodeAgent
    from hutch.integrations.smolagents import HutchExecutor

    with CodeAgent(tools=[], model=model, executor=HutchExecutor()) as agent:   # the sandbox ends with it
        agent.run("What is the 20th Fibonacci number?")

The executor is smolagents' RemotePythonExecutor over `Sandbox.run_code` (hutch's stateful interpreter,
a Jupyter kernel): variables persist between steps, tools are sent as their source (as smolagents does for
every remote executor), `final_answer` ends the run, and an error in the agent's code comes back to the
model as an execution error (the run goes on). It needs a hutch with Sandbox.run_code; without one,
HutchExecutor() raises a ConfigError that says so (smolagents needs a stateful Python; hutch does not fake
one over exec). `sandbox=`: a running hutch.Sandbox of yours; else one is made from `sandbox_options`
(default image: hutch's code-interpreter image when there is one) and ended by cleanup().
"""

from __future__ import annotations

from io import BytesIO

from hutch.integrations._common import DEFAULT_TIMEOUT, TOOL_ERRORS, Toolbox, error_text, require, run_code

_remote, _local, _utils, _mon = require("smolagents", "smolagents.remote_executors",
                                        "smolagents.local_python_executor", "smolagents.utils",
                                        "smolagents.monitoring")
RemotePythonExecutor, CodeOutput, AgentError = _remote.RemotePythonExecutor, _local.CodeOutput, _utils.AgentError


class HutchExecutor(RemotePythonExecutor):
    """Runs a CodeAgent's code in a hutch sandbox through `Sandbox.run_code`. `timeout`: seconds a step may
    run before it is interrupted (the interpreter and its state survive)."""

    def __init__(self, additional_imports: list[str] | None = None, logger=None, *, sandbox=None,
                 sandbox_options: dict | None = None, timeout: float = DEFAULT_TIMEOUT,
                 allow_pickle: bool = False) -> None:
        import hutch

        if not hasattr(sandbox if sandbox is not None else hutch.Sandbox, "run_code"):
            raise hutch.ConfigError(
                "HutchExecutor needs Sandbox.run_code (hutch's stateful code interpreter), which this hutch "
                "does not have yet: upgrade hutch, or give the agent hutch's exec tool instead.")
        opts = dict(sandbox_options or {})
        if "image" not in opts and hasattr(hutch.Image, "code_interpreter"):
            opts["image"] = hutch.Image.code_interpreter()
        super().__init__(list(additional_imports or []), logger or _mon.AgentLogger(level=_mon.LogLevel.INFO),
                         allow_pickle)
        self.toolbox = Toolbox(sandbox, sandbox_options=opts, integration="smolagents")
        self.timeout = timeout
        try:
            self.installed_packages = self.install_packages(self.additional_imports)
        except BaseException:
            self.toolbox.close()
            raise

    def run_code_raise_errors(self, code: str) -> CodeOutput:
        try:
            r = run_code(self.toolbox.sandbox, code, timeout=self.timeout)
        except TOOL_ERRORS as e:   # bad input or a sandbox failure: the model reads it as an execution error
            raise AgentError(error_text(e), self.logger) from e
        logs = r.stdout + (("\n" if r.stdout and not r.stdout.endswith("\n") else "") + r.stderr if r.stderr else "")
        if r.error is not None:
            if r.error.name == self.FINAL_ANSWER_EXCEPTION:
                return CodeOutput(output=self._deserialize_final_answer(r.error.value, self.allow_pickle),
                                  logs=logs, is_final_answer=True)
            raise AgentError(f"{logs}\nExecuting code yielded an error:\n{r.error.name}\n{r.error.value}\n"
                             f"{r.error.traceback}", self.logger)
        if r.pngs:
            import PIL.Image

            return CodeOutput(output=PIL.Image.open(BytesIO(r.pngs[0])), logs=logs, is_final_answer=False)
        return CodeOutput(output=r.text, logs=logs, is_final_answer=False)

    def cleanup(self) -> None:
        """End the sandbox this executor made (a given one is left running)."""
        self.toolbox.close()

    def delete(self) -> None:
        self.cleanup()
