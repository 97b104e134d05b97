// Code a user writes against the TypeScript client that `@hey-api/openapi-ts` generates from
// openapi/openapi.json. tests/it/clients.rs generates the client into `./generated` next to a copy
// of this file and type-checks both with `tsc --strict --noEmit`: a change to the spec that breaks
// this code (a variant renamed, a field dropped or retyped) fails the test.
import { createClient } from './generated/client';
import {
  createRun,
  getCircuitBreaker,
  getCompactionConfig,
  getRun,
  getRunOutput,
  listSessionMessages,
  listSessions,
  watchRunEvents,
} from './generated/sdk.gen';
import type {
  AgentEvent,
  ContentPart,
  CreateRunRequest,
  RunOutput,
  RunRecord,
  RunStatus,
  ToolExecutionResult,
} from './generated/types.gen';

/** Fails to compile when a case of a union is not handled. */
function unreachable(value: never): never {
  throw new Error(`unhandled: ${JSON.stringify(value)}`);
}

/** One line per event, narrowed on `type`: every variant's own fields are reachable. */
export function describe(event: AgentEvent): string {
  switch (event.type) {
    case 'run_started':
      return `run ${event.run_id} started in session ${event.session_id}`;
    case 'context_built':
      return `context built (#${event.sequence})`;
    case 'model_started':
      return `model started (#${event.sequence})`;
    case 'text_delta':
      return `text: ${event.delta}`;
    case 'reasoning_delta':
      return `reasoning (#${event.sequence})`;
    case 'tool_call_started':
      return `tool call ${event.call_id} to ${event.tool_name} started`;
    case 'tool_call_delta':
      return `tool call ${event.call_id}: ${event.delta}`;
    case 'tool_call_completed':
      return `tool call ${event.call.name}(${JSON.stringify(event.call.arguments)})`;
    case 'tool_execution_started':
      return `tool ${event.tool_name} executing`;
    case 'tool_execution_finished':
      return `tool ${event.tool_name} took ${event.duration_ms} ms: ${result(event.result)}`;
    case 'assistant_message_committed':
    case 'tool_message_committed':
      return `message committed (#${event.sequence})`;
    case 'usage_recorded':
      return `usage: ${event.usage.input_tokens} in, ${event.usage.output_tokens} out`;
    case 'cache_metrics':
      return `cache metrics (#${event.sequence})`;
    case 'run_completed':
      return `completed (#${event.sequence})`;
    case 'run_failed':
      return `failed (#${event.sequence})`;
    case 'run_cancelled':
      return `cancelled (#${event.sequence})`;
    case 'doom_loop_detected':
      return `doom loop (#${event.sequence})`;
    case 'compaction_circuit_opened':
      return `compaction circuit opened (#${event.sequence})`;
    case 'model_retrying':
      return `model retrying (#${event.sequence})`;
    case 'run_resumed':
      return `run resumed (#${event.sequence})`;
    case 'tool_calls_required':
      return `waiting for ${event.tool_calls
        .map((call) => `${call.tool_name} (${call.kind}, ${call.call_id})`)
        .join(', ')} until ${event.expires_at}`;
    case 'context_compacted':
      return `context compacted (${event.trigger}): ${event.messages_summarised} messages, ${event.tokens_before} → ${event.tokens_after} tokens`;
    case 'context_compaction_started':
      return `compacting (${event.trigger}): ${event.messages_to_summarise} messages, ${event.tokens_before} tokens, with ${event.model}`;
    case 'output_rejected':
      return `answer rejected (attempt ${event.attempt}): ${event.errors
        .map((error) => `${error.instance_path || '/'} ${error.message}`)
        .join('; ')}`;
    case 'tool_progress':
      return `${event.call_id}: ${event.progress}${event.total != null ? `/${event.total}` : ''}${event.message ? ` ${event.message}` : ''}`;
    case 'tool_approval_decided':
      return `${event.tool_name} ${event.approved ? 'approved' : 'rejected'}${event.decided_by ? ` by ${event.decided_by}` : ''}`;
    default:
      return unreachable(event);
  }
}

function result(outcome: ToolExecutionResult): string {
  if ('Success' in outcome) {
    return JSON.stringify(outcome.Success.output);
  }
  return `error: ${outcome.Failure.error}`;
}

function text(part: ContentPart): string {
  switch (part.type) {
    case 'text':
      return part.text;
    case 'json':
      return JSON.stringify(part.value);
    case 'image':
      return `[${part.media_type} ${part.url}]`;
    default:
      return unreachable(part);
  }
}

function terminal(status: RunStatus): boolean {
  switch (status) {
    case 'pending':
    case 'session_loaded':
    case 'building_context':
    case 'compacting':
    case 'calling_model':
    case 'waiting_for_tools':
    case 'requires_action':
    case 'persisting':
      return false;
    case 'completed':
    case 'failed':
    case 'cancelled':
      return true;
    default:
      return unreachable(status);
  }
}

/** Starts a run, follows its events, waits for the end and prints the answer and the session. */
export async function demo(baseUrl: string): Promise<void> {
  const client = createClient({ baseUrl });
  const body: CreateRunRequest = { provider: 'demo', model: 'demo', input: 'what time is it?' };
  const created = await createRun({ client, body, throwOnError: true });
  const runId = created.data.run_id;

  const events = await watchRunEvents({ client, path: { run_id: runId } });
  for await (const event of events.stream) {
    // The stream's type admits the 204 answer's `void`.
    if (event) {
      console.log(describe(event));
    }
  }

  let run: RunRecord = (await getRun({ client, path: { run_id: runId }, throwOnError: true })).data;
  while (!terminal(run.status)) {
    await new Promise((resolve) => setTimeout(resolve, 100));
    run = (await getRun({ client, path: { run_id: runId }, throwOnError: true })).data;
  }
  const output: RunOutput = (
    await getRunOutput({ client, path: { run_id: runId }, throwOnError: true })
  ).data;
  for (const message of output.messages) {
    console.log(message.role, message.content.map(text).join(''));
  }
  const sessions = await listSessions({ client, throwOnError: true });
  for (const session of sessions.data.sessions) {
    const messages = await listSessionMessages({
      client,
      path: { session_id: session.id },
      throwOnError: true,
    });
    console.log(session.id, messages.data.messages.length, messages.data.compactions.length);
  }
  const compaction = await getCompactionConfig({ client, throwOnError: true });
  const breaker = await getCircuitBreaker({ client, throwOnError: true });
  console.log(
    `compaction: auto ${compaction.data.auto}, keep ${compaction.data.keep_tokens} tokens; ` +
      `breaker ${breaker.data.is_open ? 'open' : 'closed'} (${breaker.data.consecutive_failures}/${breaker.data.threshold})`,
  );
}
