//! The freeze watch: fails BUILDING images that can no longer finish, so that none stays
//! BUILDING forever.
//!
//! The agent on the session's node normally reports the end of every freeze (READY, or FAILED
//! also when the session is removed or the agent restarts). The watch covers what it cannot:
//!
//! - the node has not synced for longer than `node_timeout`;
//! - the session is ENDED, FAILED or gone and the agent has not said so first;
//! - the freeze's progress (bytes read from the export, the size estimate) has not moved for
//!   `freeze_stall_timeout`: a Docker commit or export that hangs, an agent that ignores the
//!   order. A freeze queued behind others on its node counts as stalled too.
//!
//! Time is counted from the later of the fact and the watch's start, so a manager that was down
//! does not fail the freezes its agents kept running meanwhile. The image is failed with
//! [`Store::record_freeze`], as an agent's report would be: whichever comes first wins, a later
//! report is ignored, and the agent drops the order it no longer gets.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use ongrid_core::image::FreezeProgress;
use ongrid_core::{HumanDuration, SessionState};
use tokio_util::sync::CancellationToken;

use crate::clock::Clock;
use crate::store::{ImageFilter, ImageRecord, SessionRecord, Store, StoreResult};

/// How often the watch looks at the BUILDING images.
pub const WATCH_INTERVAL: Duration = Duration::from_secs(2);

/// When a freeze is given up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FreezeLimits {
    /// A node not seen for this long is offline (the manager's `node_timeout`).
    pub node_timeout: Duration,
    /// Progress that has not moved for this long (`freeze_stall_timeout`).
    pub stall_timeout: Duration,
}

/// Why `image` can no longer finish at `now`, if so. `session` is its session (`None`: gone),
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

/// The loop that applies [`stuck_reason`] to every BUILDING image.
pub struct FreezeWatch {
    store: Arc<dyn Store>,
    clock: Arc<dyn Clock>,
    limits: FreezeLimits,
    started: DateTime<Utc>,
}

impl FreezeWatch {
    pub fn new(store: Arc<dyn Store>, clock: Arc<dyn Clock>, limits: FreezeLimits) -> Self {
        let started = clock.now();
        Self {
            store,
            clock,
            limits,
            started,
        }
    }

    /// Checks every [`WATCH_INTERVAL`] until `shutdown`.
    pub async fn run(self: Arc<Self>, shutdown: CancellationToken) {
        loop {
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = tokio::time::sleep(WATCH_INTERVAL) => {}
            }
            if let Err(error) = self.check(self.clock.now()).await {
                tracing::error!(%error, "Checking the running freezes failed; retrying.");
            }
        }
    }

    /// Fails the BUILDING images that are stuck at `now`; returns them as failed.
    pub async fn check(&self, now: DateTime<Utc>) -> StoreResult<Vec<ImageRecord>> {
        let mut failed = Vec::new();
        let nodes: HashMap<_, _> = self
            .store
            .nodes()
            .await?
            .into_iter()
            .map(|node| (node.name, node.last_seen))
            .collect();
        for (node, last_seen) in &nodes {
            for image in self
                .store
                .images(ImageFilter::Building(node.clone()))
                .await?
            {
                let session = self.store.session(image.session_id).await?;
                let Some(reason) = stuck_reason(
                    &image,
                    session.as_ref(),
                    Some(*last_seen),
                    self.started,
                    now,
                    self.limits,
                ) else {
                    continue;
                };
                let progress = FreezeProgress::Failed {
                    image_id: image.id,
                    reason,
                };
                if let Some(image) = self.store.record_freeze(node, &progress, now).await? {
                    tracing::info!(image_id = %image.id, reference = %image.reference, %node, reason = %image.reason, "Freeze given up.");
                    failed.push(image);
                }
            }
        }
        Ok(failed)
    }
}

#[cfg(test)]
mod tests {
    use ongrid_core::image::{Compression, ImageReference, ImageState};
    use ongrid_core::{Dn, GpuRequest, NodeName, SessionId, SessionName, UserName};

    use super::*;

    const LIMITS: FreezeLimits = FreezeLimits {
        node_timeout: Duration::from_secs(30),
        stall_timeout: Duration::from_secs(3600),
    };

    fn t(seconds: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + seconds, 0).unwrap()
    }

    fn image() -> ImageRecord {
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
            progress_at: t(0),
            created_at: t(0),
            finished_at: None,
            superseded_at: None,
        }
    }

    fn session(state: SessionState) -> SessionRecord {
        SessionRecord {
            id: SessionId::new_random(),
            name: SessionName::parse("train1").unwrap(),
            owner: Dn::parse("/CN=Alice").unwrap(),
            user_name: UserName::parse("alice").unwrap(),
            uid: 20_000,
            state,
            reason: "container exited with code 137".to_owned(),
            request: GpuRequest::default(),
            image: "ongrid/dev:latest".to_owned(),
            node: Some(NodeName::parse("node1").unwrap()),
            gpus: Vec::new(),
            created_at: t(0),
            queued_at: t(0),
            preferred_node: None,
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
}
