//! Which messages a compaction summarises (the head) and which stay verbatim (the tail). The
//! conversation is cut only between units — a user message, or an assistant message with the
//! tool results that answer it — so a tool call is never separated from its result; the tail
//! starts with a user message, and the latest user input is always kept.

use crate::domain::{Message, Role};

/// Where a conversation is cut.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Split {
    /// The messages before this index are the head (less `pinned` and the system messages,
    /// which stay); the tail starts here.
    pub tail_start: usize,
    /// The latest user input, when it lies in the head: kept verbatim before the tail.
    pub pinned: Option<usize>,
}

impl Split {
    /// Whether the head holds anything to summarise (a message that is neither system content
    /// nor the pinned user input).
    pub fn has_head(&self, messages: &[Message]) -> bool {
        messages[..self.tail_start]
            .iter()
            .enumerate()
            .any(|(i, m)| m.role != Role::System && Some(i) != self.pinned)
    }
}

/// A run of messages the cut never splits: `[start, end)`.
#[derive(Debug, Clone, Copy)]
struct Unit {
    start: usize,
    end: usize,
    role: Role,
}

/// Units of `messages`: each message other than a tool result starts one; tool results belong
/// to the unit before them (the assistant message whose calls they answer).
fn units(messages: &[Message]) -> Vec<Unit> {
    let mut units: Vec<Unit> = Vec::new();
    for (i, message) in messages.iter().enumerate() {
        match units.last_mut() {
            Some(unit) if message.role == Role::Tool => unit.end = i + 1,
            _ => units.push(Unit {
                start: i,
                end: i + 1,
                role: message.role,
            }),
        }
    }
    units
}

/// The cut that keeps, from the end, at most `tail_turns` turns (a user message and what
/// follows it; the turn in progress counts) within `keep_tokens` (`sizes[i]` is message `i`'s
/// tokens). System messages are never cut away and count for nothing here. When the token
/// budget ends inside an older turn, the tail starts at that turn's successor (it must start
/// with a user message); when it ends inside the current turn, the latest user input is pinned
/// before the tail.
pub(super) fn split(
    messages: &[Message],
    sizes: &[u64],
    keep_tokens: u64,
    tail_turns: u32,
) -> Split {
    let units = units(messages);
    let latest_user = units.iter().rposition(|u| u.role == Role::User);
    let size = |unit: &Unit| -> u64 { sizes[unit.start..unit.end].iter().sum() };
    let mut tail_unit = units.len();
    let mut turns = 0;
    let mut tokens = 0u64;
    if tail_turns > 0 {
        for (index, unit) in units.iter().enumerate().rev() {
            if unit.role == Role::System {
                continue;
            }
            let unit_tokens = size(unit);
            if tokens.saturating_add(unit_tokens) > keep_tokens {
                break;
            }
            if unit.role == Role::User {
                turns += 1;
            } else if turns == tail_turns {
                break;
            }
            tokens += unit_tokens;
            tail_unit = index;
            if unit.role == Role::User && turns == tail_turns {
                break;
            }
        }
    }
    // A tail cut inside an older turn starts at the next user message instead.
    if let Some(latest) = latest_user
        && tail_unit < latest
        && units[tail_unit].role != Role::User
    {
        tail_unit = (tail_unit..=latest)
            .find(|&i| units[i].role == Role::User)
            .unwrap_or(latest);
    }
    let tail_start = units.get(tail_unit).map_or(messages.len(), |u| u.start);
    let pinned = latest_user
        .filter(|&latest| latest < tail_unit)
        .map(|latest| units[latest].start);
    Split { tail_start, pinned }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{ContentPart, MessageId, RunId, SessionId, ToolCall};

    fn message(role: Role, calls: usize) -> Message {
        Message {
            id: MessageId::new(),
            session_id: SessionId::new(),
            run_id: RunId::new(),
            role,
            content: vec![ContentPart::Text {
                text: "x".to_owned(),
            }],
            reasoning: Vec::new(),
            tool_calls: (0..calls)
                .map(|n| ToolCall {
                    id: format!("c{n}"),
                    name: "t".to_owned(),
                    arguments: serde_json::json!({}),
                    invalid_arguments: None,
                })
                .collect(),
            tool_call_id: None,
            tool_name: None,
            status: Default::default(),
            created_at: chrono::Utc::now(),
        }
    }

    /// u: user, a: assistant, c: assistant with one call, t: tool result, s: system.
    fn conversation(shape: &str) -> Vec<Message> {
        shape
            .chars()
            .map(|c| match c {
                'u' => message(Role::User, 0),
                'a' => message(Role::Assistant, 0),
                'c' => message(Role::Assistant, 1),
                't' => message(Role::Tool, 0),
                _ => message(Role::System, 0),
            })
            .collect()
    }

    fn cut(shape: &str, keep: u64, turns: u32) -> (usize, Option<usize>) {
        let messages = conversation(shape);
        let sizes = vec![10; messages.len()];
        let split = split(&messages, &sizes, keep, turns);
        (split.tail_start, split.pinned)
    }

    #[test]
    fn keeps_the_newest_turns_whole() {
        // Three turns of user, call, result, answer; keep two.
        //            0123456789ab
        let shape = "uctauctaucta";
        assert_eq!(cut(shape, 1000, 2), (4, None));
        assert_eq!(cut(shape, 1000, 1), (8, None));
        assert_eq!(cut(shape, 1000, 3), (0, None));
    }

    #[test]
    fn a_call_and_its_result_stay_together() {
        // A budget of 25 tokens holds the current turn's call with its result (20) but not its
        // user input too: the latest user input is pinned before them.
        let shape = "uauct";
        assert_eq!(cut(shape, 25, 2), (3, Some(2)));
        // 15 tokens would cut between the call and its result: neither is kept.
        assert_eq!(cut(shape, 15, 2), (5, Some(2)));
        // Never a tail starting at a tool result.
        for keep in 0..80 {
            let (start, _) = cut("uctctctuctct", keep, 3);
            let messages = conversation("uctctctuctct");
            assert!(
                messages.get(start).is_none_or(|m| m.role != Role::Tool),
                "keep {keep}: tail starts at a tool result ({start})"
            );
        }
    }

    #[test]
    fn a_budget_ending_in_an_older_turn_starts_at_the_next_user_message() {
        // Turns: u a | u c t a. Budget for 5 messages: the older turn's answer would be the
        // tail's first message; the tail starts at the latest user input instead.
        let (start, pinned) = cut("uaucta", 50, 2);
        assert_eq!((start, pinned), (2, None));
    }

    #[test]
    fn zero_tail_turns_keep_only_the_latest_user_input() {
        assert_eq!(cut("uauct", 1000, 0), (5, Some(2)));
    }

    #[test]
    fn system_messages_are_never_the_head() {
        let messages = conversation("suauct");
        let sizes = vec![10; messages.len()];
        let keep_all = split(&messages, &sizes, 1000, 5);
        assert_eq!(keep_all.tail_start, 1);
        assert!(!keep_all.has_head(&messages));
        let one_turn = split(&messages, &sizes, 1000, 1);
        assert_eq!((one_turn.tail_start, one_turn.pinned), (3, None));
        assert!(one_turn.has_head(&messages));
        // Only the pinned input before the tail: nothing to summarise.
        let only_pinned = conversation("uct");
        let split = split(&only_pinned, &[10, 10, 10], 20, 1);
        assert_eq!((split.tail_start, split.pinned), (1, Some(0)));
        assert!(!split.has_head(&only_pinned));
    }
}
