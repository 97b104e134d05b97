"""Drives a running `behest serve` through the Python client that openapi-generator generates
from openapi/openapi.json (run by tests/it/clients.rs with the generated package on PYTHONPATH).

Usage: drive.py BASE_URL SPEC_PATH

Every answer is parsed into the generated models (the generated API methods deserialize and
validate them; this script checks their types): a response the models cannot hold fails here.
"""

import json
import sys
import time

import behest_client
from behest_client import models

TERMINAL = {models.RunStatus.COMPLETED, models.RunStatus.FAILED, models.RunStatus.CANCELLED}


def expect(value, model):
    if not isinstance(value, model):
        raise SystemExit(f"expected a {model.__name__}, got {type(value).__name__}: {value!r}")
    return value


def main(base_url: str, spec_path: str) -> None:
    with open(spec_path, encoding="utf-8") as spec_file:
        spec = json.load(spec_file)
    # No schema dropped: every component schema of the spec is a generated model, but for
    # aliases of a plain string (`RunId`: a UUID), which the models use as `str`.
    missing = [
        name
        for name, schema in spec["components"]["schemas"].items()
        if not hasattr(models, name) and not (schema.get("type") == "string" and "enum" not in schema)
    ]
    if missing:
        raise SystemExit(f"schemas without a generated model: {missing}")

    config = behest_client.Configuration(host=base_url)
    with behest_client.ApiClient(config) as api:
        runs = behest_client.RunsApi(api)
        sessions = behest_client.SessionsApi(api)
        providers = expect(behest_client.ProvidersApi(api).list_providers(), models.ProviderList)
        provider = providers.providers[0]
        if (provider.id, provider.models[0].name) != ("demo", "demo"):
            raise SystemExit(f"not the demo provider: {provider!r}")
        tools = expect(behest_client.ToolsApi(api).list_tools(), models.ToolList)
        if [tool.name for tool in tools.tools] != ["current_time"]:
            raise SystemExit(f"not the demo tool: {tools!r}")

        created = runs.create_run(
            # `input` is a string or a list of parts (a oneOf): the generator wraps it.
            models.CreateRunRequest(
                provider="demo", model="demo", input=models.RunInput("what time is it?")
            )
        )
        expect(created, models.CreateRunResponse)

        deadline = time.monotonic() + 60
        while True:
            run = expect(runs.get_run(created.run_id), models.RunRecord)
            if run.status in TERMINAL:
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"run not finished after 60 s: {run!r}")
            time.sleep(0.1)
        if run.status != models.RunStatus.COMPLETED:
            raise SystemExit(f"run ended {run.status}: {run!r}")

        output = expect(runs.get_run_output(created.run_id), models.RunOutput)
        if output.iterations != 2 or output.total_usage.output_tokens <= 0:
            raise SystemExit(f"unexpected output: {output!r}")
        for message in output.messages:
            expect(message, models.Message)
            for part in message.content:
                expect(part, models.ContentPart)
        # The assistant called the tool, then answered from its result.
        calls = [call for message in output.messages for call in (message.tool_calls or [])]
        if [expect(call, models.ToolCall).name for call in calls] != ["current_time"]:
            raise SystemExit(f"no current_time call: {output.messages!r}")
        answer = output.messages[-1].content[0].actual_instance
        expect(answer, models.ContentPartOneOf)
        if not answer.text.startswith("`current_time` answered {"):
            raise SystemExit(f"unexpected answer: {answer.text!r}")

        listed = expect(sessions.list_sessions(), models.ListSessionsResponse)
        if created.session_id not in [session.id for session in listed.sessions]:
            raise SystemExit(f"session {created.session_id} not listed: {listed!r}")
        for session in listed.sessions:
            expect(session, models.Session)
        history = expect(
            sessions.list_session_messages(created.session_id), models.SessionMessages
        )
        roles = [message.role for message in history.messages]
        if roles != [models.Role.USER, models.Role.ASSISTANT, models.Role.TOOL, models.Role.ASSISTANT]:
            raise SystemExit(f"unexpected history: {roles}")
        print(f"python client: run {created.run_id} answered {answer.text!r}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
