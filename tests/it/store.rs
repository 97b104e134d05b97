//! The store suite, run against SQLite and PostgreSQL alike.

use crate::support;

use std::sync::Arc;

use behest::domain::{
    ContentPart, FinishReason, Message, MessageId, Role, RunEnd, RunId, RunStatus, SessionId,
    TokenUsage, ToolCall, ToolChoice,
};
use behest::events::LoggedEvent;
use behest::store::{EventWrite, NewRun, RunChange, RunFilter, Store, StoreError};
use chrono::Utc;
use serde_json::json;
use support::db::{Backend, TestDb};

fn new_run(session_id: SessionId, create_session: bool) -> NewRun {
    NewRun {
        id: RunId::new(),
        session_id,
        create_session,
        provider: "fake".to_owned(),
        model: "fake-model".to_owned(),
        tool_choice: ToolChoice::default(),
        metadata: json!({"zeta": 1, "alpha": "é ✓ 🌍", "nested": {"b": [1, 2], "a": null}}),
        input: behest::domain::RunInput::from("Bonjour, ça va ? 你好").content(),
        user_message_id: MessageId::new(),
        tools: None,
        agent: None,
        definition: Default::default(),
        session_defaults: None,
        max_iterations: 25,
        client_request_id: None,
        request_hash: None,
        created_at: Utc::now(),
        lease: None,
    }
}

fn event(sequence: u64, event_type: &str, terminal: bool) -> Arc<LoggedEvent> {
    Arc::new(LoggedEvent {
        sequence,
        event_type: event_type.to_owned(),
        data: Arc::from(format!(
            r#"{{"sequence":{sequence},"type":"{event_type}","z":1,"a":"ü"}}"#
        )),
        terminal,
    })
}

async fn open(backend: Backend) -> Option<(TestDb, Arc<dyn Store>)> {
    let db = TestDb::new(backend).await?;
    let store = db.store().await;
    Some((db, store))
}

async fn create_run_stores_session_run_and_user_message(backend: Backend) {
    let Some((db, store)) = open(backend).await else {
        return;
    };
    let run = new_run(SessionId::new(), true);
    let record = store.create_run(&run).await.unwrap();
    assert_eq!(record.id, run.id);
    assert_eq!(record.status, RunStatus::Pending);
    assert_eq!(record.metadata, run.metadata);
    assert_eq!(record.total_usage, TokenUsage::default());
    assert_eq!(store.get_run(run.id).await.unwrap(), Some(record));
    assert!(store.get_session(run.session_id).await.unwrap().is_some());
    let messages = store.session_messages(run.session_id).await.unwrap();
    assert_eq!(messages.len(), 1);
    assert_eq!(messages[0].role, Role::User);
    assert_eq!(messages[0].content, run.input);
    assert_eq!(messages[0].id, run.user_message_id);
    db.cleanup().await;
}

async fn run_in_missing_session_writes_nothing(backend: Backend) {
    let Some((db, store)) = open(backend).await else {
        return;
    };
    let missing = SessionId::new();
    let run = new_run(missing, false);
    let error = store.create_run(&run).await.unwrap_err();
    assert!(
        matches!(error, StoreError::SessionNotFound(id) if id == missing),
        "{error}"
    );
    assert_eq!(store.get_run(run.id).await.unwrap(), None);
    assert!(store.session_messages(missing).await.unwrap().is_empty());
    let all = store
        .list_runs(&RunFilter {
            limit: 10,
            ..RunFilter::default()
        })
        .await
        .unwrap();
    assert!(all.is_empty());
    db.cleanup().await;
}

fn status(status: RunStatus) -> RunChange {
    RunChange {
        status: Some(status),
        ..RunChange::default()
    }
}

/// Appends one event at `sequence` carrying `change`.
async fn apply(store: &dyn Store, run_id: RunId, sequence: u64, change: RunChange) {
    let write = EventWrite {
        run_id,
        event: event(sequence, "text_delta", false),
        outcome: None,
        change,
    };
    store.append_events(&[write]).await.unwrap();
}

async fn complete(store: &dyn Store, run_id: RunId) {
    let write = EventWrite {
        run_id,
        event: event(1, "run_completed", true),
        outcome: Some(RunEnd::Completed {
            finish_reason: FinishReason::Stop,
            parsed: None,
        }),
        change: RunChange::default(),
    };
    store.append_events(&[write]).await.unwrap();
}

async fn list_runs_filters_and_pages_newest_first(backend: Backend) {
    let Some((db, store)) = open(backend).await else {
        return;
    };
    let first = new_run(SessionId::new(), true);
    store.create_run(&first).await.unwrap();
    let mut ids = vec![first.id];
    for _ in 0..4 {
        complete(store.as_ref(), *ids.last().unwrap()).await;
        let run = new_run(first.session_id, false);
        store.create_run(&run).await.unwrap();
        ids.push(run.id);
    }
    let other = new_run(SessionId::new(), true);
    store.create_run(&other).await.unwrap();
    apply(store.as_ref(), ids[4], 1, status(RunStatus::CallingModel)).await;

    let page = store
        .list_runs(&RunFilter {
            session_id: Some(first.session_id),
            limit: 3,
            ..RunFilter::default()
        })
        .await
        .unwrap();
    let got: Vec<RunId> = page.iter().map(|r| r.id).collect();
    assert_eq!(got, vec![ids[4], ids[3], ids[2]]);
    let next = store
        .list_runs(&RunFilter {
            session_id: Some(first.session_id),
            before: Some(ids[2]),
            limit: 3,
            ..RunFilter::default()
        })
        .await
        .unwrap();
    let got: Vec<RunId> = next.iter().map(|r| r.id).collect();
    assert_eq!(got, vec![ids[1], ids[0]]);
    let calling = store
        .list_runs(&RunFilter {
            status: Some(RunStatus::CallingModel),
            limit: 10,
            ..RunFilter::default()
        })
        .await
        .unwrap();
    assert_eq!(
        calling.iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![ids[4]]
    );
    db.cleanup().await;
}

async fn events_round_trip_and_terminal_outcome_is_atomic(backend: Backend) {
    let Some((db, store)) = open(backend).await else {
        return;
    };
    let run = new_run(SessionId::new(), true);
    store.create_run(&run).await.unwrap();
    let writes: Vec<EventWrite> = (1..=5)
        .map(|n| EventWrite {
            run_id: run.id,
            event: event(n, "text_delta", false),
            outcome: None,
            change: RunChange::default(),
        })
        .collect();
    store.append_events(&writes).await.unwrap();
    assert_eq!(store.last_sequence(run.id).await.unwrap(), 5);

    // A batch holding a duplicate sequence fails whole: neither the new event nor the outcome.
    let bad = vec![
        EventWrite {
            run_id: run.id,
            event: event(6, "usage_recorded", false),
            outcome: None,
            change: RunChange::default(),
        },
        EventWrite {
            run_id: run.id,
            event: event(5, "run_completed", true),
            outcome: Some(RunEnd::Completed {
                finish_reason: FinishReason::Stop,
                parsed: None,
            }),
            change: RunChange::default(),
        },
    ];
    assert!(store.append_events(&bad).await.is_err());
    assert_eq!(store.last_sequence(run.id).await.unwrap(), 5);
    assert_eq!(
        store.get_run(run.id).await.unwrap().unwrap().status,
        RunStatus::Pending
    );

    let terminal = vec![EventWrite {
        run_id: run.id,
        event: event(6, "run_completed", true),
        outcome: Some(RunEnd::Completed {
            finish_reason: FinishReason::Stop,
            parsed: None,
        }),
        change: RunChange::default(),
    }];
    store.append_events(&terminal).await.unwrap();
    let record = store.get_run(run.id).await.unwrap().unwrap();
    assert_eq!(record.status, RunStatus::Completed);
    assert_eq!(record.finish_reason, Some(FinishReason::Stop));

    let all = store.read_events(run.id, 0, 100).await.unwrap();
    assert_eq!(
        all.iter().map(|e| e.sequence).collect::<Vec<_>>(),
        vec![1, 2, 3, 4, 5, 6]
    );
    assert_eq!(all[5], *event(6, "run_completed", true));
    assert_eq!(
        all[0].data,
        event(1, "text_delta", false).data,
        "byte-exact data"
    );
    let tail = store.read_events(run.id, 3, 2).await.unwrap();
    assert_eq!(
        tail.iter().map(|e| e.sequence).collect::<Vec<_>>(),
        vec![4, 5]
    );

    // Terminal runs keep their status.
    apply(store.as_ref(), run.id, 7, status(RunStatus::CallingModel)).await;
    assert_eq!(
        store.get_run(run.id).await.unwrap().unwrap().status,
        RunStatus::Completed
    );
    assert!(store.active_runs().await.unwrap().is_empty());
    db.cleanup().await;
}

async fn messages_keep_order_parts_and_tool_calls(backend: Backend) {
    let Some((db, store)) = open(backend).await else {
        return;
    };
    let run = new_run(SessionId::new(), true);
    store.create_run(&run).await.unwrap();
    let call = ToolCall {
        invalid_arguments: None,
        id: "call_1".to_owned(),
        name: "get_weather".to_owned(),
        arguments: json!({"city": "Zürich"}),
    };
    let invalid = ToolCall {
        invalid_arguments: Some("{\"city\": \"Zür".to_owned()),
        id: "call_2".to_owned(),
        name: "get_weather".to_owned(),
        arguments: json!({}),
    };
    // Reasoning blocks (a signed one, a redacted one) are stored with the message.
    let assistant = Message {
        reasoning: vec![
            behest::domain::Reasoning {
                text: "The user wants the weather.".to_owned(),
                signature: Some("sig-1".to_owned()),
                redacted_data: None,
            },
            behest::domain::Reasoning {
                text: String::new(),
                signature: None,
                redacted_data: Some("opaque".to_owned()),
            },
        ],
        id: MessageId::new(),
        session_id: run.session_id,
        run_id: run.id,
        role: Role::Assistant,
        content: vec![ContentPart::Text {
            text: "Checking… 🌦".to_owned(),
        }],
        tool_calls: vec![call.clone(), invalid],
        tool_call_id: None,
        tool_name: None,
        created_at: Utc::now(),
        status: Default::default(),
    };
    let tool = Message {
        id: MessageId::new(),
        role: Role::Tool,
        content: vec![ContentPart::Json {
            value: json!({"temp_c": 3.5}),
        }],
        reasoning: Vec::new(),
        tool_calls: Vec::new(),
        tool_call_id: Some(call.id.clone()),
        tool_name: Some(call.name.clone()),
        ..assistant.clone()
    };
    let with_message = |message: &Message| RunChange {
        message: Some(message.clone()),
        ..RunChange::default()
    };
    apply(store.as_ref(), run.id, 1, with_message(&assistant)).await;
    apply(store.as_ref(), run.id, 2, with_message(&tool)).await;
    // A batch that fails writes none of its messages.
    let failing = EventWrite {
        run_id: run.id,
        event: event(2, "tool_message_committed", false),
        outcome: None,
        change: with_message(&Message {
            id: MessageId::new(),
            ..tool.clone()
        }),
    };
    assert!(store.append_events(&[failing]).await.is_err());
    let messages = store.session_messages(run.session_id).await.unwrap();
    assert_eq!(messages.len(), 3);
    assert_eq!(
        messages[1],
        Message {
            created_at: messages[1].created_at,
            status: Default::default(),
            ..assistant.clone()
        }
    );
    assert_eq!(messages[2].tool_call_id.as_deref(), Some("call_1"));
    assert_eq!(messages[2].content, tool.content);
    let assistants = store.run_messages(run.id, Role::Assistant).await.unwrap();
    assert_eq!(
        assistants.iter().map(|m| m.id).collect::<Vec<_>>(),
        vec![assistant.id]
    );
    db.cleanup().await;
}

async fn progress_and_active_runs(backend: Backend) {
    let Some((db, store)) = open(backend).await else {
        return;
    };
    let run = new_run(SessionId::new(), true);
    store.create_run(&run).await.unwrap();
    // Reasoning tokens and the estimate mark are persisted with the totals.
    let usage = TokenUsage {
        reasoning_tokens: 3,
        estimated: true,
        input_tokens: 10,
        output_tokens: 5,
        total_tokens: 15,
    };
    let progress = RunChange {
        status: Some(RunStatus::WaitingForTools),
        progress: Some((2, usage)),
        ..RunChange::default()
    };
    apply(store.as_ref(), run.id, 1, progress).await;
    let record = store.get_run(run.id).await.unwrap().unwrap();
    assert_eq!(
        (record.iterations, record.total_usage, record.status),
        (2, usage, RunStatus::WaitingForTools)
    );
    assert_eq!(
        store
            .active_runs()
            .await
            .unwrap()
            .iter()
            .map(|r| r.id)
            .collect::<Vec<_>>(),
        vec![run.id]
    );
    db.cleanup().await;
}

async fn one_active_run_per_session_and_idempotency_keys(backend: Backend) {
    let Some((db, store)) = open(backend).await else {
        return;
    };
    let mut first = new_run(SessionId::new(), true);
    first.client_request_id = Some("req-1".to_owned());
    first.request_hash = Some("hash-a".to_owned());
    let record = store.create_run(&first).await.unwrap();
    assert_eq!(record.client_request_id.as_deref(), Some("req-1"));

    let busy = new_run(first.session_id, false);
    match store.create_run(&busy).await {
        Err(StoreError::SessionBusy { active_run, .. }) => assert_eq!(active_run, first.id),
        other => panic!("expected SessionBusy, got {other:?}"),
    }
    // Nothing of the refused run was written: no run, no user message.
    assert_eq!(store.get_run(busy.id).await.unwrap(), None);
    assert_eq!(
        store
            .session_messages(first.session_id)
            .await
            .unwrap()
            .len(),
        1
    );

    for (hash, same) in [("hash-a", true), ("hash-b", false)] {
        let mut retry = new_run(SessionId::new(), true);
        retry.client_request_id = Some("req-1".to_owned());
        retry.request_hash = Some(hash.to_owned());
        match store.create_run(&retry).await {
            Err(StoreError::DuplicateRequest {
                existing,
                same_request,
            }) => {
                assert_eq!((existing.id, same_request), (first.id, same));
            }
            other => panic!("expected DuplicateRequest, got {other:?}"),
        }
        assert_eq!(
            store.get_session(retry.session_id).await.unwrap(),
            None,
            "rolled back"
        );
    }
    match store.delete_session(first.session_id).await {
        Err(StoreError::SessionBusy { active_run, .. }) => assert_eq!(active_run, first.id),
        other => panic!("expected SessionBusy, got {other:?}"),
    }
    complete(store.as_ref(), first.id).await;
    let next = new_run(first.session_id, false);
    store.create_run(&next).await.unwrap();
    complete(store.as_ref(), next.id).await;
    let sessions = store.list_sessions(None, 10).await.unwrap();
    assert_eq!(
        sessions.iter().map(|s| s.id).collect::<Vec<_>>(),
        vec![first.session_id]
    );
    assert!(store.delete_session(first.session_id).await.unwrap());
    assert_eq!(
        store.get_run(first.id).await.unwrap(),
        None,
        "runs go with the session"
    );
    assert!(store.read_events(first.id, 0, 10).await.unwrap().is_empty());
    assert!(!store.delete_session(first.session_id).await.unwrap());
    db.cleanup().await;
}

pub(crate) fn lease(owner: &str, expires_ms: i64) -> behest::store::Lease {
    behest::store::Lease {
        owner: owner.to_owned(),
        expires_ms,
    }
}

pub(crate) fn now_ms() -> i64 {
    Utc::now().timestamp_millis()
}

/// Inputs to one idle session from several processes at once (each its own pool, as replicas
/// behind a load balancer): one run starts, every other gets `SessionBusy` naming it — never a
/// database error (PostgreSQL's deadlock detector ended the loser's transaction when both took a
/// shared lock on the session and then both wanted to update it).
async fn concurrent_inputs_to_one_session_are_busy_never_an_error(backend: Backend) {
    let Some((db, store)) = open(backend).await else {
        return;
    };
    let mut replicas = vec![store.clone()];
    for _ in 0..3 {
        replicas.push(db.store().await);
    }
    let first = new_run(SessionId::new(), true);
    let session_id = first.session_id;
    complete(store.as_ref(), store.create_run(&first).await.unwrap().id).await;
    for round in 0..15 {
        let attempts = replicas.iter().flat_map(|replica| {
            (0..2).map(|_| {
                let replica = replica.clone();
                let run = new_run(session_id, false);
                async move { replica.create_run(&run).await }
            })
        });
        let results = futures::future::join_all(attempts).await;
        let started: Vec<RunId> = results
            .iter()
            .filter_map(|r| r.as_ref().ok().map(|run| run.id))
            .collect();
        assert_eq!(started.len(), 1, "round {round}: {results:?}");
        for result in &results {
            match result {
                Ok(_) => {}
                Err(StoreError::SessionBusy { active_run, .. }) => {
                    assert_eq!(*active_run, started[0], "round {round}");
                }
                Err(other) => panic!("round {round}: {other:?}"),
            }
        }
        complete(store.as_ref(), started[0]).await;
    }
}

/// A run created by `owner` with a lease expiring at `expires_ms`.
pub(crate) async fn leased_run(store: &dyn Store, owner: &str, expires_ms: i64) -> RunId {
    let mut run = new_run(SessionId::new(), true);
    run.lease = Some(lease(owner, expires_ms));
    store.create_run(&run).await.unwrap();
    run.id
}

fn write(run_id: RunId, sequence: u64) -> EventWrite {
    EventWrite {
        run_id,
        event: event(sequence, "text_delta", false),
        outcome: None,
        change: RunChange::default(),
    }
}

async fn leases_claims_and_fencing(backend: Backend) {
    let Some((db, store)) = open(backend).await else {
        return;
    };
    let store = store.as_ref();
    let live = leased_run(store, "a", now_ms() + 60_000).await;
    let expired = leased_run(store, "a", now_ms() - 1).await;

    // Only the expired lease is taken over; a forced claim (a single-process store at
    // startup) takes the live one too; a process never claims its own runs.
    let claimed = store
        .claim_runs(&lease("b", now_ms() + 60_000), now_ms(), false, 100)
        .await
        .unwrap();
    let ids: Vec<RunId> = claimed.iter().map(|c| c.record.id).collect();
    assert_eq!(ids, vec![expired]);
    assert!(
        store
            .claim_runs(&lease("b", now_ms() + 60_000), now_ms(), false, 100)
            .await
            .unwrap()
            .is_empty(),
        "a claimed run is not claimed again"
    );
    assert!(
        store
            .claim_run(live, &lease("b", now_ms() + 60_000), now_ms())
            .await
            .unwrap()
            .is_none(),
        "a live lease is not taken by a single claim either"
    );

    // Fencing: `a` lost `expired` to `b`; a batch with both runs writes only `live`'s event.
    let refused = store
        .append_events_as(Some("a"), &[write(live, 1), write(expired, 1)])
        .await
        .unwrap();
    assert_eq!(refused.fenced, vec![expired]);
    assert_eq!(store.last_sequence(live).await.unwrap(), 1);
    assert_eq!(store.last_sequence(expired).await.unwrap(), 0);
    let refused = store
        .append_events_as(Some("b"), &[write(expired, 1)])
        .await
        .unwrap();
    assert!(refused.is_empty());
    assert_eq!(store.last_sequence(expired).await.unwrap(), 1);

    // A writer whose events do not continue a run's stored log (a stopped task's late events,
    // the same sequence written twice) is refused for that run only: no duplicate key fails
    // the batch, and the other runs' events in it are written.
    let refused = store
        .append_events_as(Some("b"), &[write(expired, 1), write(expired, 2)])
        .await
        .unwrap();
    assert_eq!(refused.fenced, vec![expired], "sequence 1 is taken");
    let refused = store
        .append_events_as(Some("a"), &[write(live, 3), write(live, 2)])
        .await
        .unwrap();
    assert_eq!(
        refused.fenced,
        vec![live],
        "a gap in the log is refused too"
    );
    let refused = store
        .append_events_as(Some("b"), &[write(expired, 2), write(expired, 3)])
        .await
        .unwrap();
    assert!(refused.is_empty(), "the next sequences are written");
    assert_eq!(store.last_sequence(expired).await.unwrap(), 3);
    assert_eq!(store.last_sequence(live).await.unwrap(), 1);

    // Renewal reports what the owner still holds and the cancels requested meanwhile.
    assert!(store.request_cancel(live).await.unwrap());
    let renewal = store.renew_leases("a", now_ms() + 60_000).await.unwrap();
    assert_eq!(renewal.owned, vec![live]);
    assert_eq!(renewal.cancel_requested, vec![live]);

    // Released leases are taken over at once, with the cancel request.
    store.release_leases("a").await.unwrap();
    let claimed = store
        .claim_runs(&lease("c", now_ms() + 60_000), now_ms(), false, 100)
        .await
        .unwrap();
    assert_eq!(claimed.len(), 1);
    assert_eq!(claimed[0].record.id, live);
    assert!(claimed[0].cancel_requested);

    // Forced: every non-terminal run not already this owner's.
    let claimed = store
        .claim_runs(&lease("d", now_ms() + 60_000), now_ms(), true, 100)
        .await
        .unwrap();
    assert_eq!(claimed.len(), 2);
    let terminal = EventWrite {
        run_id: live,
        event: event(2, "run_cancelled", true),
        outcome: Some(RunEnd::Cancelled),
        change: RunChange::default(),
    };
    store.append_events(&[terminal]).await.unwrap();
    assert!(!store.request_cancel(live).await.unwrap(), "terminal");
    db.cleanup().await;
}

async fn snapshots_follow_boundaries_and_retention_removes_them(backend: Backend) {
    let Some((db, store)) = open(backend).await else {
        return;
    };
    let store = store.as_ref();
    let session = SessionId::new();
    let run = new_run(session, true);
    store.create_run(&run).await.unwrap();
    assert!(store.get_snapshot(run.id).await.unwrap().is_none());
    let usage = TokenUsage {
        input_tokens: 10,
        output_tokens: 5,
        total_tokens: 15,
        ..TokenUsage::default()
    };
    store
        .append_events(&[boundary(&run, 1, 1, usage)])
        .await
        .unwrap();
    store
        .append_events(&[boundary(&run, 2, 2, usage)])
        .await
        .unwrap();
    let snapshot = store.get_snapshot(run.id).await.unwrap().unwrap();
    assert_eq!(snapshot.status, RunStatus::CallingModel);
    assert_eq!(snapshot.iteration, 2);
    assert_eq!(snapshot.last_sequence, 2);
    assert_eq!(snapshot.tool_calls, 1);
    assert_eq!(snapshot.total_usage.total_tokens, 15);
    assert!(matches!(
        store.delete_snapshot(run.id).await,
        Err(StoreError::RunActive(id)) if id == run.id
    ));
    let listed = store
        .list_snapshots(&behest::store::SnapshotFilter {
            session_id: Some(session),
            status: Some(RunStatus::CallingModel),
            before: None,
            limit: 10,
        })
        .await
        .unwrap();
    assert_eq!(listed, vec![snapshot]);

    // The terminal event's transaction gives the snapshot the run's final status.
    let terminal = EventWrite {
        run_id: run.id,
        event: event(3, "run_completed", true),
        outcome: Some(RunEnd::Completed {
            finish_reason: FinishReason::Stop,
            parsed: None,
        }),
        change: RunChange::default(),
    };
    store.append_events(&[terminal]).await.unwrap();
    let finished = store.get_snapshot(run.id).await.unwrap().unwrap();
    assert_eq!(finished.status, RunStatus::Completed);
    assert_eq!(finished.last_sequence, 3);
    assert_eq!(finished.iteration, 2);

    // Retention: only runs that ended before the cutoff lose their events and snapshot.
    let active = new_run(SessionId::new(), true);
    store.create_run(&active).await.unwrap();
    apply(store, active.id, 1, status(RunStatus::CallingModel)).await;
    let past = Utc::now() - chrono::Duration::hours(1);
    assert_eq!(store.remove_expired_events(past, 10).await.unwrap(), 0);
    let later = Utc::now() + chrono::Duration::seconds(1);
    assert_eq!(store.remove_expired_events(later, 10).await.unwrap(), 1);
    assert_eq!(store.remove_expired_events(later, 10).await.unwrap(), 0);
    assert_eq!(store.last_sequence(run.id).await.unwrap(), 0);
    assert!(store.get_snapshot(run.id).await.unwrap().is_none());
    let record = store.get_run(run.id).await.unwrap().unwrap();
    assert!(record.events_removed_at.is_some());
    assert_eq!(store.session_messages(session).await.unwrap().len(), 1);
    assert_eq!(store.last_sequence(active.id).await.unwrap(), 1);
    assert!(!store.delete_snapshot(run.id).await.unwrap(), "none left");
    db.cleanup().await;
}

/// Answers to a paused run: stored only while it waits on that turn and before its deadline,
/// each call once (of two concurrent submissions one wins), and `close_action` sees every
/// submission that came before it; the required action is cleared when the run moves on.
async fn answers_to_a_paused_run(backend: Backend) {
    use behest::domain::{ActionAnswer, PendingKind, PendingToolCall, RequiredAction};
    use behest::store::SubmitOutcome;
    let Some((db, store)) = open(backend).await else {
        return;
    };
    let run = new_run(SessionId::new(), true);
    store.create_run(&run).await.unwrap();
    let message_id = MessageId::new();
    let action = |expires_at| RequiredAction {
        message_id,
        tool_calls: vec![PendingToolCall {
            call_id: "call_1".to_owned(),
            tool_name: "get_location".to_owned(),
            arguments: json!({}),
            kind: PendingKind::ClientTool,
        }],
        expires_at,
    };
    let answer = vec![(
        "call_1".to_owned(),
        ActionAnswer::Output(json!({"city": "Paris"})),
    )];
    let now = behest::store::unix_ms(Utc::now());
    // Not waiting yet.
    assert_eq!(
        store
            .submit_answers(run.id, message_id, &answer, now)
            .await
            .unwrap(),
        SubmitOutcome::NotWaiting(RunStatus::Pending)
    );
    let paused = RunChange {
        status: Some(RunStatus::RequiresAction),
        required_action: Some(action(Utc::now() + chrono::Duration::minutes(5))),
        ..RunChange::default()
    };
    apply(store.as_ref(), run.id, 1, paused).await;
    let record = store.get_run(run.id).await.unwrap().unwrap();
    assert_eq!(record.status, RunStatus::RequiresAction);
    assert_eq!(
        record.required_action.as_ref().unwrap().message_id,
        message_id
    );
    // Another turn's message id, a passed deadline: refused.
    assert_eq!(
        store
            .submit_answers(run.id, MessageId::new(), &answer, now)
            .await
            .unwrap(),
        SubmitOutcome::NotWaiting(RunStatus::RequiresAction)
    );
    let later = now + 10 * 60 * 1000;
    assert_eq!(
        store
            .submit_answers(run.id, message_id, &answer, later)
            .await
            .unwrap(),
        SubmitOutcome::Expired
    );
    // Two at once: one is stored, the other finds the call answered.
    let (a, b) = tokio::join!(
        store.submit_answers(run.id, message_id, &answer, now),
        store.submit_answers(run.id, message_id, &answer, now)
    );
    let mut outcomes = [a.unwrap(), b.unwrap()].to_vec();
    outcomes.sort_by_key(|o| format!("{o:?}"));
    assert_eq!(
        outcomes,
        [
            SubmitOutcome::Accepted,
            SubmitOutcome::AlreadyAnswered("call_1".to_owned())
        ]
    );
    assert_eq!(
        store.close_action(run.id, message_id).await.unwrap(),
        answer
    );
    assert_eq!(
        store.action_answers(run.id, message_id).await.unwrap(),
        answer
    );
    // A later turn that uses the same call id again (after a compaction, or a server that
    // numbers its calls) waits for an answer of its own: the earlier one is not its.
    let later_turn = MessageId::new();
    let later = RunChange {
        status: Some(RunStatus::RequiresAction),
        required_action: Some(RequiredAction {
            message_id: later_turn,
            ..action(Utc::now() + chrono::Duration::minutes(5))
        }),
        ..RunChange::default()
    };
    apply(store.as_ref(), run.id, 2, later).await;
    assert_eq!(
        store.action_answers(run.id, later_turn).await.unwrap(),
        vec![]
    );
    let second = vec![(
        "call_1".to_owned(),
        ActionAnswer::Output(json!({"city": "Lyon"})),
    )];
    assert_eq!(
        store
            .submit_answers(run.id, later_turn, &second, now)
            .await
            .unwrap(),
        SubmitOutcome::Accepted
    );
    assert_eq!(
        store.action_answers(run.id, later_turn).await.unwrap(),
        second
    );
    assert_eq!(
        store.action_answers(run.id, message_id).await.unwrap(),
        answer,
        "each turn keeps its own answers"
    );
    // The run moves on: the required action is gone, answers are refused.
    apply(
        store.as_ref(),
        run.id,
        3,
        status(RunStatus::WaitingForTools),
    )
    .await;
    let record = store.get_run(run.id).await.unwrap().unwrap();
    assert_eq!(record.required_action, None);
    assert_eq!(
        store
            .submit_answers(run.id, message_id, &answer, now)
            .await
            .unwrap(),
        SubmitOutcome::NotWaiting(RunStatus::WaitingForTools)
    );
    assert_eq!(
        store
            .submit_answers(RunId::new(), message_id, &answer, now)
            .await
            .unwrap(),
        SubmitOutcome::NotFound
    );
    db.cleanup().await;
}

/// Sessions made without a run, changed, and read page by page; the first run of a session
/// records its defaults, a later one does not.
async fn sessions_pages_and_defaults(backend: Backend) {
    use behest::domain::{Session, SessionDefaults};
    use behest::store::SessionPatch;
    let Some((db, store)) = open(backend).await else {
        return;
    };
    let now = Utc::now();
    let session = Session {
        id: SessionId::new(),
        created_at: now,
        updated_at: now,
        title: Some("t".to_owned()),
        metadata: json!({"k": 1}),
        defaults: SessionDefaults::default(),
        external_id: Some("Xk3_q9-ZpLmN0aBc".to_owned()),
    };
    let created = store.create_session(&session).await.unwrap();
    assert_eq!(
        (&created.title, &created.metadata, &created.external_id),
        (&session.title, &session.metadata, &session.external_id)
    );
    assert_eq!(
        store.get_session(session.id).await.unwrap(),
        Some(created.clone())
    );
    // The client's id finds the session; another session may not take it; sessions without
    // one do not collide.
    assert_eq!(
        store
            .session_by_external_id("Xk3_q9-ZpLmN0aBc")
            .await
            .unwrap(),
        Some(created)
    );
    assert_eq!(store.session_by_external_id("other").await.unwrap(), None);
    let taken = store
        .create_session(&Session {
            id: SessionId::new(),
            ..session.clone()
        })
        .await
        .unwrap_err();
    assert!(
        matches!(&taken, behest::store::StoreError::ExternalIdTaken(id) if id == "Xk3_q9-ZpLmN0aBc"),
        "{taken:?}"
    );
    for _ in 0..2 {
        store
            .create_session(&Session {
                id: SessionId::new(),
                external_id: None,
                ..session.clone()
            })
            .await
            .unwrap();
    }
    let patched = store
        .update_session(
            session.id,
            &SessionPatch {
                title: Some(None),
                metadata: Some(json!({"k": 2})),
            },
            Utc::now(),
        )
        .await
        .unwrap()
        .unwrap();
    assert_eq!((patched.title, patched.metadata), (None, json!({"k": 2})));
    assert_eq!(
        store
            .update_session(SessionId::new(), &SessionPatch::default(), Utc::now())
            .await
            .unwrap(),
        None
    );
    let remember = |model: &str| SessionDefaults {
        model: Some(model.to_owned()),
        ..SessionDefaults::default()
    };
    for model in ["first", "second"] {
        let mut run = new_run(session.id, false);
        run.session_defaults = Some(remember(model));
        store.create_run(&run).await.unwrap();
        let mut done = EventWrite {
            run_id: run.id,
            event: event(1, "run_completed", true),
            outcome: Some(RunEnd::Completed {
                finish_reason: FinishReason::Stop,
                parsed: None,
            }),
            change: RunChange::default(),
        };
        done.change.status = None;
        store.append_events(&[done]).await.unwrap();
    }
    let stored = store.get_session(session.id).await.unwrap().unwrap();
    assert_eq!(stored.defaults, remember("first"), "only the first run's");
    let all = store.session_messages(session.id).await.unwrap();
    let first = store
        .session_messages_page(session.id, None, 1)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(first, all[..1]);
    let rest = store
        .session_messages_page(session.id, Some(first[0].id), 10)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(rest, all[1..]);
    assert_eq!(
        store
            .session_messages_page(SessionId::new(), Some(first[0].id), 10)
            .await
            .unwrap(),
        None,
        "a cursor of another session"
    );
    db.cleanup().await;
}

/// A message of `run` in its session.
fn message_of(run: &NewRun, role: Role, text: &str) -> Message {
    Message {
        id: MessageId::new(),
        session_id: run.session_id,
        run_id: run.id,
        role,
        content: vec![ContentPart::Text {
            text: text.to_owned(),
        }],
        reasoning: Vec::new(),
        tool_calls: Vec::new(),
        tool_call_id: None,
        tool_name: None,
        status: Default::default(),
        created_at: Utc::now(),
    }
}

/// Compactions: stored with their event, listed in message order; a run's context starts from
/// the latest one (system messages, the latest user input it covers, then what follows); the
/// session's calibration; the settings; the breaker counted atomically by concurrent failures,
/// opened once, closed by a success or a reset.
async fn compactions_context_settings_and_breaker(backend: Backend) {
    let Some((db, store)) = open(backend).await else {
        return;
    };
    let run = new_run(SessionId::new(), true);
    store.create_run(&run).await.unwrap();
    let system = message_of(&run, Role::System, "Be brief.");
    let answer = message_of(&run, Role::Assistant, "Hello.");
    let later = message_of(&run, Role::Assistant, "Still there.");
    for (sequence, message) in [(1, &system), (2, &answer)] {
        let change = RunChange {
            message: Some(message.clone()),
            ..RunChange::default()
        };
        apply(store.as_ref(), run.id, sequence, change).await;
    }
    let context = store.session_context(run.session_id).await.unwrap();
    assert_eq!(context.compaction, None);
    assert_eq!(context.messages.len(), 3, "everything without a compaction");
    assert_eq!(context.calibration, None);
    // A compaction through the answer: it covers the user input, which stays in the context.
    let compaction = behest::domain::Compaction {
        id: behest::domain::CompactionId::new(),
        session_id: run.session_id,
        run_id: Some(run.id),
        trigger: behest::domain::CompactionTrigger::Auto,
        through_message_id: answer.id,
        messages_summarised: 1,
        tokens_before: 900,
        tokens_after: 300,
        summary: "They said hello. ✓".to_owned(),
        provider: "fake".to_owned(),
        model: "fake-model".to_owned(),
        usage: TokenUsage {
            input_tokens: 800,
            output_tokens: 20,
            total_tokens: 820,
            reasoning_tokens: 0,
            estimated: false,
        },
        created_at: Utc::now(),
    };
    let threshold = 3;
    let failure = store
        .record_compaction_failure("boom", threshold)
        .await
        .unwrap();
    assert!(!failure.opened);
    let calibration = behest::store::Calibration {
        reported_tokens: 1_200,
        counted_tokens: 1_000,
    };
    let change = RunChange {
        compaction: Some(compaction.clone()),
        calibration: Some((run.session_id, calibration)),
        ..RunChange::default()
    };
    apply(store.as_ref(), run.id, 3, change).await;
    let breaker = store.circuit_breaker(threshold).await.unwrap();
    assert_eq!(
        (breaker.consecutive_failures, breaker.last_error),
        (0, None),
        "a success closes the breaker"
    );
    let change = RunChange {
        message: Some(later.clone()),
        ..RunChange::default()
    };
    apply(store.as_ref(), run.id, 4, change).await;
    let context = store.session_context(run.session_id).await.unwrap();
    let stored = context.compaction.clone().unwrap();
    assert_eq!(stored.id, compaction.id);
    assert_eq!(stored.summary, compaction.summary);
    assert_eq!(stored.usage, compaction.usage);
    let ids: Vec<MessageId> = context.messages.iter().map(|m| m.id).collect();
    assert_eq!(ids, vec![system.id, run.user_message_id, later.id]);
    assert_eq!(context.calibration, Some(calibration));
    assert_eq!(
        store.session_compactions(run.session_id).await.unwrap(),
        vec![stored]
    );
    // A compaction outside a run is refused while one is active.
    let manual = behest::domain::Compaction {
        id: behest::domain::CompactionId::new(),
        run_id: None,
        trigger: behest::domain::CompactionTrigger::Manual,
        through_message_id: later.id,
        ..compaction.clone()
    };
    assert!(matches!(
        store.insert_compaction(&manual).await,
        Err(StoreError::SessionBusy { .. })
    ));
    let terminal = EventWrite {
        run_id: run.id,
        event: event(5, "run_completed", true),
        outcome: Some(RunEnd::Completed {
            finish_reason: FinishReason::Stop,
            parsed: None,
        }),
        change: RunChange::default(),
    };
    store.append_events(&[terminal]).await.unwrap();
    store.insert_compaction(&manual).await.unwrap();
    let context = store.session_context(run.session_id).await.unwrap();
    assert_eq!(
        context.compaction.unwrap().id,
        manual.id,
        "the latest covers the most"
    );
    let ids: Vec<MessageId> = context.messages.iter().map(|m| m.id).collect();
    assert_eq!(ids, vec![system.id, run.user_message_id]);
    assert_eq!(
        store
            .session_compactions(run.session_id)
            .await
            .unwrap()
            .len(),
        2
    );
    // Settings.
    assert_eq!(store.compaction_config().await.unwrap(), None);
    let settings = behest::domain::CompactionConfig {
        prune: true,
        keep_tokens: Some(1_234),
        provider: "fake".to_owned(),
        model: "fake-model".to_owned(),
        ..behest::domain::CompactionConfig::default()
    };
    store.put_compaction_config(&settings).await.unwrap();
    store.put_compaction_config(&settings).await.unwrap();
    assert_eq!(store.compaction_config().await.unwrap(), Some(settings));
    // Ten concurrent failures: each counted, the breaker opened by exactly one of them.
    let failures = futures::future::join_all((0..10).map(|n| {
        let store = store.clone();
        async move {
            store
                .record_compaction_failure(&format!("failure {n}"), threshold)
                .await
                .unwrap()
        }
    }))
    .await;
    assert_eq!(failures.iter().filter(|f| f.opened).count(), 1);
    let breaker = store.circuit_breaker(threshold).await.unwrap();
    assert!(breaker.is_open);
    assert_eq!(breaker.consecutive_failures, 10);
    assert!(breaker.opened_at.is_some());
    assert!(breaker.last_error.unwrap().starts_with("failure "));
    let reset = store.reset_circuit_breaker(threshold).await.unwrap();
    assert_eq!(
        reset,
        behest::domain::CircuitBreaker {
            is_open: false,
            consecutive_failures: 0,
            threshold,
            opened_at: None,
            last_error: None,
        }
    );
    db.cleanup().await;
}

/// Starts stored together (group commit): each run's refusal is its own and writes nothing of
/// it; the others of the batch are stored whole.
async fn a_batch_of_starts_refuses_each_run_alone(backend: Backend) {
    let Some((db, store)) = open(backend).await else {
        return;
    };
    let existing = new_run(SessionId::new(), true);
    store.create_run(&existing).await.unwrap();
    complete(store.as_ref(), existing.id).await;

    let mut keyed = new_run(SessionId::new(), true);
    keyed.client_request_id = Some("batch-1".to_owned());
    keyed.request_hash = Some("hash-a".to_owned());
    // The same key again in the same batch: the retry of the run just before it.
    let mut retry = new_run(SessionId::new(), true);
    retry.client_request_id = Some("batch-1".to_owned());
    retry.request_hash = Some("hash-a".to_owned());
    let in_session = new_run(existing.session_id, false);
    // A second run of that session in the same batch: it has an active run by then.
    let busy = new_run(existing.session_id, false);
    let missing = new_run(SessionId::new(), false);
    let fresh = new_run(SessionId::new(), true);
    let batch = [
        keyed.clone(),
        retry.clone(),
        in_session.clone(),
        busy.clone(),
        missing.clone(),
        fresh.clone(),
    ];
    let results = store.create_runs(&batch).await;
    assert_eq!(results.len(), batch.len());
    assert_eq!(results[0].as_ref().unwrap().id, keyed.id);
    match &results[1] {
        Err(StoreError::DuplicateRequest {
            existing,
            same_request,
        }) => assert_eq!((existing.id, *same_request), (keyed.id, true)),
        other => panic!("expected DuplicateRequest, got {other:?}"),
    }
    assert_eq!(results[2].as_ref().unwrap().id, in_session.id);
    match &results[3] {
        Err(StoreError::SessionBusy { active_run, .. }) => assert_eq!(*active_run, in_session.id),
        other => panic!("expected SessionBusy, got {other:?}"),
    }
    match &results[4] {
        Err(StoreError::SessionNotFound(id)) => assert_eq!(*id, missing.session_id),
        other => panic!("expected SessionNotFound, got {other:?}"),
    }
    assert_eq!(results[5].as_ref().unwrap().id, fresh.id);
    // Nothing of a refused run: no run, no session, no user message.
    for refused in [&retry, &busy, &missing] {
        assert_eq!(store.get_run(refused.id).await.unwrap(), None);
    }
    assert_eq!(store.get_session(retry.session_id).await.unwrap(), None);
    let messages = store.session_messages(existing.session_id).await.unwrap();
    assert_eq!(
        messages.iter().map(|m| m.run_id).collect::<Vec<_>>(),
        vec![existing.id, in_session.id]
    );
    for stored in [&keyed, &fresh] {
        let messages = store.session_messages(stored.session_id).await.unwrap();
        assert_eq!(messages.len(), 1);
        assert_eq!(messages[0].id, stored.user_message_id);
    }
    db.cleanup().await;
}

/// A session's context read since a known message: only what was stored after it; the whole
/// context once the session is compacted.
async fn context_after_a_known_message(backend: Backend) {
    use behest::store::ContextUpdate;
    let Some((db, store)) = open(backend).await else {
        return;
    };
    let first = new_run(SessionId::new(), true);
    let session_id = first.session_id;
    let read = async |after: Option<MessageId>| match store
        .session_context_after(session_id, after)
        .await
        .unwrap()
    {
        ContextUpdate::Appended { messages, .. } => {
            messages.iter().map(|m| m.id).collect::<Vec<_>>()
        }
        ContextUpdate::Compacted(_) => panic!("a session never compacted reads as appended"),
    };
    store.create_run(&first).await.unwrap();
    assert_eq!(read(None).await, vec![first.user_message_id]);
    complete(store.as_ref(), first.id).await;
    let second = new_run(session_id, false);
    store.create_run(&second).await.unwrap();
    assert_eq!(
        read(Some(first.user_message_id)).await,
        vec![second.user_message_id]
    );
    assert_eq!(read(Some(second.user_message_id)).await, vec![]);
    // A message of another session is no cursor here: nothing, never the whole session again.
    let other = new_run(SessionId::new(), true);
    store.create_run(&other).await.unwrap();
    assert_eq!(read(Some(other.user_message_id)).await, vec![]);
    db.cleanup().await;
}

/// An event at `sequence` of `run` opening iteration `iteration` with `usage` so far (a
/// `model_started`: status, progress and the boundary's snapshot, one tool call per earlier
/// iteration).
fn boundary(run: &NewRun, sequence: u64, iteration: u32, usage: TokenUsage) -> EventWrite {
    EventWrite {
        run_id: run.id,
        event: event(sequence, "model_started", false),
        outcome: None,
        change: RunChange {
            status: Some(RunStatus::CallingModel),
            progress: Some((iteration, usage)),
            snapshot: Some(behest::store::SnapshotWrite {
                session_id: run.session_id,
                iteration,
                total_usage: usage,
                tool_calls: iteration - 1,
            }),
            ..RunChange::default()
        },
    }
}

/// One batch holding several runs' changes, interleaved, one run reaching two boundaries and
/// another ending: each run's row and snapshot read as if its events were written one after
/// another (the batch merges a run's consecutive changes into one write).
async fn a_batch_of_runs_changes_reads_as_one_after_another(backend: Backend) {
    let Some((db, store)) = open(backend).await else {
        return;
    };
    let runs: Vec<NewRun> = (0..3).map(|_| new_run(SessionId::new(), true)).collect();
    for run in &runs {
        store.create_run(run).await.unwrap();
    }
    let usage = |n: u64| TokenUsage {
        input_tokens: n,
        output_tokens: 1,
        total_tokens: n + 1,
        ..TokenUsage::default()
    };
    let (a, b, c) = (&runs[0], &runs[1], &runs[2]);
    let mut ended = write(c.id, 3);
    ended.event = event(3, "run_completed", true);
    ended.outcome = Some(RunEnd::Completed {
        finish_reason: FinishReason::Stop,
        parsed: None,
    });
    let batch = vec![
        boundary(a, 1, 1, usage(10)),
        boundary(b, 1, 1, usage(20)),
        boundary(c, 1, 1, usage(30)),
        // `a` again after others: its second boundary wins.
        boundary(a, 2, 2, usage(40)),
        write(b.id, 2),
        // `c` reaches a boundary and ends in the same batch.
        boundary(c, 2, 2, usage(50)),
        ended,
    ];
    store.append_events(&batch).await.unwrap();
    let row = async |run: &NewRun| {
        let record = store.get_run(run.id).await.unwrap().unwrap();
        let snapshot = store.get_snapshot(run.id).await.unwrap().unwrap();
        (
            record.status,
            record.iterations,
            record.total_usage.input_tokens,
            snapshot.status,
            snapshot.iteration,
            snapshot.total_usage.input_tokens,
            snapshot.last_sequence,
        )
    };
    use RunStatus::{CallingModel, Completed};
    assert_eq!(row(a).await, (CallingModel, 2, 40, CallingModel, 2, 40, 2));
    assert_eq!(row(b).await, (CallingModel, 1, 20, CallingModel, 1, 20, 1));
    assert_eq!(row(c).await, (Completed, 2, 50, Completed, 2, 50, 3));
    db.cleanup().await;
}

/// Cancel and completion race through the run's row (issue 23, item 2): a completion or
/// failure written after a cancel was recorded is refused — the batch's other events are
/// written, the run's status stays, and its cancelled end is written next; a cancel asked
/// after a run ended is not recorded (the API answers `409 run_finished`).
async fn a_cancel_recorded_first_wins_over_the_end(backend: Backend) {
    let Some((db, store)) = open(backend).await else {
        return;
    };
    let store = store.as_ref();
    let cancelled = leased_run(store, "a", now_ms() + 60_000).await;
    let finished = leased_run(store, "a", now_ms() + 60_000).await;
    let ending = |run_id, sequence, end: RunEnd| {
        let kind = match end.status() {
            RunStatus::Completed => "run_completed",
            RunStatus::Failed => "run_failed",
            _ => "run_cancelled",
        };
        EventWrite {
            run_id,
            event: event(sequence, kind, true),
            outcome: Some(end),
            change: RunChange::default(),
        }
    };
    let completed = RunEnd::Completed {
        finish_reason: FinishReason::Stop,
        parsed: None,
    };
    assert!(store.request_cancel(cancelled).await.unwrap());

    let refused = store
        .append_events_as(
            Some("a"),
            &[
                write(cancelled, 1),
                ending(cancelled, 2, completed.clone()),
                write(finished, 1),
                ending(finished, 2, completed.clone()),
            ],
        )
        .await
        .unwrap();
    assert_eq!(refused.cancelled, vec![cancelled]);
    assert!(refused.fenced.is_empty());
    assert_eq!(store.last_sequence(cancelled).await.unwrap(), 1);
    let status = |run| async move { store.get_run(run).await.unwrap().unwrap().status };
    assert!(!status(cancelled).await.is_terminal());
    assert_eq!(store.last_sequence(finished).await.unwrap(), 2);
    assert_eq!(status(finished).await, RunStatus::Completed);

    let failed = RunEnd::failed(behest::domain::ErrorClass::Internal, "boom");
    let refused = store
        .append_events_as(Some("a"), &[ending(cancelled, 2, failed)])
        .await
        .unwrap();
    assert_eq!(
        refused.cancelled,
        vec![cancelled],
        "a failure is refused too"
    );
    assert!(!status(cancelled).await.is_terminal());
    let refused = store
        .append_events_as(Some("a"), &[ending(cancelled, 2, RunEnd::Cancelled)])
        .await
        .unwrap();
    assert!(refused.is_empty());
    assert_eq!(status(cancelled).await, RunStatus::Cancelled);

    assert!(
        !store.request_cancel(finished).await.unwrap(),
        "a cancel after the completion was recorded"
    );
    assert_eq!(status(finished).await, RunStatus::Completed);
    db.cleanup().await;
}

on_both_backends!(
    a_cancel_recorded_first_wins_over_the_end,
    concurrent_inputs_to_one_session_are_busy_never_an_error,
    a_batch_of_runs_changes_reads_as_one_after_another,
    a_batch_of_starts_refuses_each_run_alone,
    context_after_a_known_message,
    compactions_context_settings_and_breaker,
    answers_to_a_paused_run,
    sessions_pages_and_defaults,
    one_active_run_per_session_and_idempotency_keys,
    create_run_stores_session_run_and_user_message,
    run_in_missing_session_writes_nothing,
    list_runs_filters_and_pages_newest_first,
    events_round_trip_and_terminal_outcome_is_atomic,
    messages_keep_order_parts_and_tool_calls,
    progress_and_active_runs,
    leases_claims_and_fencing,
    snapshots_follow_boundaries_and_retention_removes_them,
);
