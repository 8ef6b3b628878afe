//! The rules of frozen images: which sessions can be frozen, what a node's agent is told to
//! freeze, what an agent's report does to an image (BUILDING → READY or FAILED), which image
//! a new freeze supersedes, what removing one does, and when a freeze that cannot finish is
//! given up.
//!
//! The store calls [`supersedes`] inside the transaction that records a new freeze, so that two
//! freezes of one tag can never both be current, and [`delete`] inside the one that removes an
//! image, so that it sees the state it writes over.

use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use ongrid_core::image::{Compression, FreezeOrder, FreezeProgress, ImageReference, ImageState};
use ongrid_core::{Dn, HumanDuration, NodeName, SessionId, SessionName, SessionState, UserName};

use crate::domain::sessions::SessionRecord;
use crate::domain::Refusal;

/// A frozen image as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageRecord {
    pub id: uuid::Uuid,
    pub owner: Dn,
    pub user_name: UserName,
    pub reference: ImageReference,
    pub state: ImageState,
    pub reason: String,
    pub session_id: SessionId,
    pub session_name: SessionName,
    /// Where the session ran, so where the freeze runs and the Docker image lives.
    pub node: NodeName,
    pub base_image: String,
    pub compression: Compression,
    pub digest: Option<String>,
    pub size: Option<u64>,
    pub sif_path: Option<String>,
    pub docker_image: Option<String>,
    pub bytes_done: u64,
    pub bytes_total: u64,
    /// When `bytes_done`/`bytes_total` last changed (at first: when the freeze was requested).
    pub progress_at: DateTime<Utc>,
    pub created_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
    pub superseded_at: Option<DateTime<Utc>>,
    /// Since when its owner shares it (`devctl image share`); `None` while private.
    pub shared_at: Option<DateTime<Utc>>,
}

/// Session states whose container exists and can be committed.
const FREEZABLE: [SessionState; 4] = [
    SessionState::Waiting,
    SessionState::Connected,
    SessionState::Idle,
    SessionState::Held,
];

/// The node that freezes `session`: where its container is, when it has one.
pub fn freezing_node(session: &SessionRecord) -> Result<NodeName, Refusal> {
    match (&session.node, FREEZABLE.contains(&session.state)) {
        (Some(node), true) => Ok(node.clone()),
        _ => Err(Refusal::Conflict(format!(
            "session {} is {} and has no container to freeze: freeze a session that has started \
             (WAITING, CONNECTED, IDLE or HELD); see `devctl session show {}`",
            session.name, session.state, session.name
        ))),
    }
}

/// Whether a new freeze of a tag supersedes the owner's current image of that tag, in `state`:
/// a FAILED one always, a READY one when forced (`--force`), a BUILDING one never (it is
/// refused, as when a READY one is not forced).
pub fn supersedes(state: ImageState, force: bool) -> bool {
    match state {
        ImageState::Failed => true,
        ImageState::Ready => force,
        ImageState::Building | ImageState::Deleted => false,
    }
}

/// The freeze orders of a node, from its BUILDING images: the agent works on each until it
/// reports it done or failed.
pub fn freeze_orders(building: Vec<ImageRecord>) -> Vec<FreezeOrder> {
    building
        .into_iter()
        .map(|image| FreezeOrder {
            image_id: image.id,
            session_id: image.session_id,
            session_name: image.session_name,
            owner: image.owner,
            reference: image.reference.to_string(),
            base_image: image.base_image,
            compression: image.compression,
            requested_at: image.created_at,
        })
        .collect()
}

/// What a report on a BUILDING image does to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageChange {
    /// Still BUILDING: bytes read so far, of an estimated total (0: unknown).
    Progress { bytes_done: u64, bytes_total: u64 },
    /// READY, with its artifacts.
    Ready {
        reason: String,
        digest: String,
        size: u64,
        sif_path: String,
        docker_image: String,
    },
    /// FAILED, with a reason the user can act on.
    Failed { reason: String },
}

impl ImageChange {
    /// The state the image is in after the change.
    pub fn state(&self) -> ImageState {
        match self {
            Self::Progress { .. } => ImageState::Building,
            Self::Ready { .. } => ImageState::Ready,
            Self::Failed { .. } => ImageState::Failed,
        }
    }
}

/// What the report of `node`'s agent on one of its freezes does to the image.
pub fn follow_report(progress: &FreezeProgress, node: &NodeName) -> ImageChange {
    match progress {
        FreezeProgress::Running {
            bytes_done,
            bytes_total,
            ..
        } => ImageChange::Progress {
            bytes_done: *bytes_done,
            bytes_total: *bytes_total,
        },
        FreezeProgress::Done {
            digest,
            size,
            sif_path,
            docker_image,
            ..
        } => ImageChange::Ready {
            reason: format!("frozen on {node}"),
            digest: digest.clone(),
            size: *size,
            sif_path: sif_path.clone(),
            docker_image: docker_image.clone(),
        },
        FreezeProgress::Failed { reason, .. } => ImageChange::Failed {
            reason: reason.clone(),
        },
    }
}

/// An image's removal (`devctl image rm`), as a rule decided it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageDeletion {
    /// DELETED from then on.
    pub at: DateTime<Utc>,
    /// The reason it keeps: its own, or for a BUILDING one that its freeze was given up (its
    /// agent cancels the freeze when the image leaves its freeze orders).
    pub reason: String,
}

/// What removing `image` at `at` does to it: DELETED, a BUILDING one with the reason that it
/// was deleted while building; `None` when it is DELETED already.
pub fn delete(image: &ImageRecord, at: DateTime<Utc>) -> Option<ImageDeletion> {
    let reason = match image.state {
        ImageState::Deleted => return None,
        ImageState::Building => "deleted while building".to_owned(),
        ImageState::Ready | ImageState::Failed => image.reason.clone(),
    };
    Some(ImageDeletion { at, reason })
}

/// When a freeze is given up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FreezeLimits {
    /// A node not seen for this long is offline (the manager's `node_timeout`).
    pub node_timeout: Duration,
    /// Progress that has not moved for this long (`freeze_stall_timeout`).
    pub stall_timeout: Duration,
}

/// Why `image` can no longer finish at `now`, if so: the agent on the session's node normally
/// reports the end of every freeze, this covers what it cannot (a node that stopped syncing, a
/// session that ended or failed first, progress that stopped moving for `stall_timeout`). Time
/// is counted from the later of the fact and `since`, when the watch started, so a manager that
/// was down does not fail the freezes its agents kept running meanwhile. `session` is its session (`None`: gone),
/// `node_seen` the last sync of its node (`None`: not registered), `since` when the watch
/// started.
pub fn stuck_reason(
    image: &ImageRecord,
    session: Option<&SessionRecord>,
    node_seen: Option<DateTime<Utc>>,
    since: DateTime<Utc>,
    now: DateTime<Utc>,
    limits: FreezeLimits,
) -> Option<String> {
    let name = &image.session_name;
    let node = &image.node;
    let again = format!(
        "freeze again with `devctl freeze {name} --tag {}`",
        image.reference
    );
    match session {
        None => return Some(format!("session {name} was removed during the freeze")),
        Some(s) if s.state == SessionState::Ended => {
            return Some(format!("session {name} was removed during the freeze"));
        }
        Some(s) if s.state == SessionState::Failed => {
            return Some(format!(
                "session {name} failed during the freeze ({}): start a new session to freeze",
                s.reason
            ));
        }
        Some(_) => {}
    }
    let longer_than = |from: DateTime<Utc>, limit: Duration| {
        let limit = TimeDelta::from_std(limit).unwrap_or(TimeDelta::MAX);
        now.signed_duration_since(from.max(since)) > limit
    };
    if node_seen.is_none_or(|seen| longer_than(seen, limits.node_timeout)) {
        return Some(format!(
            "node {node} stopped responding during the freeze: {again} once `devctl session \
             show {name}` shows it running"
        ));
    }
    if longer_than(image.progress_at, limits.stall_timeout) {
        return Some(format!(
            "the freeze made no progress on node {node} for {}: {again}, or ask the admin to \
             check Docker on {node}",
            HumanDuration(limits.stall_timeout)
        ));
    }
    None
}

/// The change that gives `image` up at `now`, when it can no longer finish.
pub fn give_up(
    image: &ImageRecord,
    session: Option<&SessionRecord>,
    node_seen: Option<DateTime<Utc>>,
    since: DateTime<Utc>,
    now: DateTime<Utc>,
    limits: FreezeLimits,
) -> Option<ImageChange> {
    stuck_reason(image, session, node_seen, since, now, limits)
        .map(|reason| ImageChange::Failed { reason })
}

#[cfg(test)]
pub(crate) mod fixtures {
    use ongrid_core::image::{Compression, ImageReference, ImageState};
    use ongrid_core::{Dn, NodeName, SessionId, SessionName, UserName};

    use super::*;

    /// Alice's BUILDING freeze of `mymodel:v1` from session `train1`, started at the tests' `t(0)`.
    pub fn image() -> ImageRecord {
        let t0 = DateTime::from_timestamp(1_800_000_000, 0).unwrap();
        ImageRecord {
            id: uuid::Uuid::new_v4(),
            owner: Dn::parse("/CN=Alice").unwrap(),
            user_name: UserName::parse("alice").unwrap(),
            reference: ImageReference::parse("mymodel:v1").unwrap(),
            state: ImageState::Building,
            reason: String::new(),
            session_id: SessionId::new_random(),
            session_name: SessionName::parse("train1").unwrap(),
            node: NodeName::parse("node1").unwrap(),
            base_image: "ongrid/dev:latest".to_owned(),
            compression: Compression::Gzip,
            digest: None,
            size: None,
            sif_path: None,
            docker_image: None,
            bytes_done: 0,
            bytes_total: 0,
            progress_at: t0,
            created_at: t0,
            finished_at: None,
            superseded_at: None,
            shared_at: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::fixtures::image;

    use super::*;
    use crate::domain::fixtures::t;

    const LIMITS: FreezeLimits = FreezeLimits {
        node_timeout: Duration::from_secs(30),
        stall_timeout: Duration::from_secs(3600),
    };

    fn session(state: SessionState) -> SessionRecord {
        SessionRecord {
            reason: "container exited with code 137".to_owned(),
            node: Some(NodeName::parse("node1").unwrap()),
            created_at: t(0),
            queued_at: t(0),
            ..crate::domain::sessions::fixtures::session("train1", state)
        }
    }

    #[test]
    fn a_freeze_on_a_live_node_with_progress_goes_on() {
        let image = image();
        for state in [SessionState::Waiting, SessionState::Held] {
            let reason = stuck_reason(
                &image,
                Some(&session(state)),
                Some(t(3590)),
                t(0),
                t(3600),
                LIMITS,
            );
            assert_eq!(reason, None, "{state}");
        }
    }

    #[test]
    fn an_ended_failed_or_missing_session_fails_the_freeze() {
        let image = image();
        let ended = session(SessionState::Ended);
        let reason = stuck_reason(&image, Some(&ended), Some(t(1)), t(0), t(2), LIMITS).unwrap();
        assert_eq!(reason, "session train1 was removed during the freeze");
        let failed = session(SessionState::Failed);
        let reason = stuck_reason(&image, Some(&failed), Some(t(1)), t(0), t(2), LIMITS).unwrap();
        assert!(
            reason.contains("failed during the freeze (container exited with code 137)"),
            "{reason}"
        );
        let reason = stuck_reason(&image, None, Some(t(1)), t(0), t(2), LIMITS).unwrap();
        assert!(reason.contains("removed"), "{reason}");
    }

    #[test]
    fn an_offline_node_fails_the_freeze_after_the_node_timeout() {
        let image = image();
        let live = session(SessionState::Connected);
        let at = |now| stuck_reason(&image, Some(&live), Some(t(100)), t(0), now, LIMITS);
        assert_eq!(at(t(130)), None);
        let reason = at(t(131)).unwrap();
        assert!(
            reason.starts_with("node node1 stopped responding during the freeze"),
            "{reason}"
        );
        assert!(
            reason.contains("devctl freeze train1 --tag mymodel:v1"),
            "{reason}"
        );
        // A manager that just started gives the node a full timeout to sync.
        let restarted = |now| stuck_reason(&image, Some(&live), Some(t(100)), t(500), now, LIMITS);
        assert_eq!(restarted(t(530)), None);
        assert!(restarted(t(531)).is_some());
        // A node that is not registered is offline.
        assert!(stuck_reason(&image, Some(&live), None, t(0), t(1), LIMITS).is_some());
    }

    #[test]
    fn a_freeze_without_progress_for_the_stall_timeout_fails() {
        let mut image = image();
        image.progress_at = t(1000);
        let live = session(SessionState::Idle);
        let at = |image: &ImageRecord, now: DateTime<Utc>| {
            stuck_reason(image, Some(&live), Some(now), t(0), now, LIMITS)
        };
        assert_eq!(at(&image, t(4600)), None);
        let reason = at(&image, t(4601)).unwrap();
        assert!(
            reason.starts_with("the freeze made no progress on node node1 for 1 hour"),
            "{reason}"
        );
        image.progress_at = t(4000);
        assert_eq!(at(&image, t(4601)), None);
    }

    #[test]
    fn only_sessions_with_a_container_are_frozen() {
        for state in SessionState::ALL {
            let result = freezing_node(&session(state));
            assert_eq!(result.is_ok(), FREEZABLE.contains(&state), "{state}");
        }
        let pending = session(SessionState::Pending);
        assert_eq!(
            freezing_node(&pending).unwrap_err().to_string(),
            "session train1 is PENDING and has no container to freeze: freeze a session that \
             has started (WAITING, CONNECTED, IDLE or HELD); see `devctl session show train1`"
        );
    }

    #[test]
    fn a_new_freeze_supersedes_failed_images_and_forced_ready_ones() {
        assert!(supersedes(ImageState::Failed, false));
        assert!(!supersedes(ImageState::Ready, false));
        assert!(supersedes(ImageState::Ready, true));
        assert!(!supersedes(ImageState::Building, true));
    }

    #[test]
    fn reports_become_image_changes_and_orders_list_building_images() {
        let node = NodeName::parse("node1").unwrap();
        let image = image();
        let running = FreezeProgress::Running {
            image_id: image.id,
            bytes_done: 5,
            bytes_total: 10,
        };
        assert_eq!(
            follow_report(&running, &node),
            ImageChange::Progress {
                bytes_done: 5,
                bytes_total: 10
            }
        );
        let done = FreezeProgress::Done {
            image_id: image.id,
            digest: "sha256:ab".to_owned(),
            size: 7,
            sif_path: "/store/sha256/ab.sif".to_owned(),
            docker_image: "ongrid/alice/mymodel:v1".to_owned(),
        };
        let ready = follow_report(&done, &node);
        assert_eq!(ready.state(), ImageState::Ready);
        assert!(matches!(&ready, ImageChange::Ready { reason, .. } if reason == "frozen on node1"));
        let failed = FreezeProgress::Failed {
            image_id: image.id,
            reason: "disk full".to_owned(),
        };
        assert_eq!(
            follow_report(&failed, &node),
            ImageChange::Failed {
                reason: "disk full".to_owned()
            }
        );
        let orders = freeze_orders(vec![image.clone()]);
        assert_eq!(orders.len(), 1);
        assert_eq!(orders[0].image_id, image.id);
        assert_eq!(orders[0].reference, "mymodel:v1");
        assert_eq!(orders[0].requested_at, image.created_at);
    }

    #[test]
    fn deleting_gives_up_a_freeze_keeps_a_finished_reason_and_happens_once() {
        let mut image = image();
        image.state = ImageState::Building;
        image.reason = "requested by alice".to_owned();
        assert_eq!(
            delete(&image, t(5)),
            Some(ImageDeletion {
                at: t(5),
                reason: "deleted while building".to_owned()
            })
        );
        for state in [ImageState::Ready, ImageState::Failed] {
            image.state = state;
            image.reason = format!("{state} on node1");
            assert_eq!(
                delete(&image, t(6)),
                Some(ImageDeletion {
                    at: t(6),
                    reason: format!("{state} on node1")
                }),
                "{state}"
            );
        }
        image.state = ImageState::Deleted;
        assert_eq!(delete(&image, t(7)), None);
    }

    #[test]
    fn a_stuck_freeze_is_given_up_as_failed() {
        let image = image();
        let ended = session(SessionState::Ended);
        let change = give_up(&image, Some(&ended), Some(t(1)), t(0), t(2), LIMITS).unwrap();
        assert_eq!(change.state(), ImageState::Failed);
        let live = session(SessionState::Idle);
        assert_eq!(
            give_up(&image, Some(&live), Some(t(1)), t(0), t(2), LIMITS),
            None
        );
    }
}
