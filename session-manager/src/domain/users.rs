//! Removing a user and re-admitting them (`devctl admin user rm | restore`).
//!
//! A removal keeps the history: the user's row stays, marked removed (when, by which admin), so
//! the audit log of SSH connections and their ENDED sessions still name who they were, and their
//! login name and UID are never given to anyone else. What they had goes:
//!
//! - their SSH keys are deleted at once, in the transaction that marks them removed (the
//!   gateway's key check then closes their open SSH connections);
//! - their sessions that have not ended are ENDED through the normal end path
//!   ([`super::sessions::requests::remove`]; agents remove the containers) — but a removal is
//!   refused while any is not ENDED unless forced (`--force`), so an admin does not end someone's
//!   work by accident; the same for their running batch jobs, which a forced removal cancels
//!   ([`super::jobs::cancel_by_owner`]: killed);
//! - their queued batch jobs are cancelled ([`super::jobs::cancel_queued`]);
//! - their frozen images are removed as `devctl image rm` does ([`super::images::delete`];
//!   agents untag the Docker images).
//!
//! A removed user who comes back with a valid certificate is refused (403, [`admission`]) until
//! an admin restores them (`devctl admin user restore DN`), which clears the mark; what was
//! removed stays removed. Both are written to the user's history of admin actions.

use std::fmt::Write as _;

use chrono::{DateTime, Utc};
use ongrid_core::job::{JobId, JobReason, JobState, HALT_GRACE};
use ongrid_core::{Dn, SessionId, SessionState, UserName};

use super::images::ImageRecord;
use super::jobs::{self, JobChange, JobRecord};
use super::sessions::{requests, Change, SessionRecord};
use super::{utc, Refusal};

/// That a user was removed: when and by which admin.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Removed {
    pub at: DateTime<Utc>,
    pub by: Dn,
}

/// Whether `dn` may use the manager: not when an admin removed them, with what to do.
pub fn admission(dn: &Dn, removed: Option<&Removed>) -> Result<(), Refusal> {
    match removed {
        None => Ok(()),
        Some(removed) => Err(Refusal::Forbidden(removal_message(dn, removed))),
    }
}

/// What `dn`, removed by an admin, is told (a refused request, a closed connection).
pub fn removal_message(dn: &Dn, removed: &Removed) -> String {
    format!(
        "an admin ({}) removed your account {dn} on {}: its keys, sessions and images are \
         gone; to be re-admitted, ask a site admin to run `devctl admin user restore '{dn}'`",
        removed.by,
        utc(removed.at)
    )
}

/// Checks that `caller` (an admin) may remove `target` (`removed`: whether they are already)
/// now, given their sessions and jobs: never themselves, never twice; not while a session has
/// not ENDED or a job runs, unless `force`; never while a job is halting (it ends within
/// [`HALT_GRACE`], and a restartable one would queue its next job).
pub fn check_removal(
    target: &Dn,
    removed: Option<&Removed>,
    caller: &Dn,
    sessions: &[SessionRecord],
    jobs: &[JobRecord],
    force: bool,
) -> Result<(), Refusal> {
    if target == caller {
        return Err(Refusal::Conflict(
            "you cannot remove yourself: another admin can".to_owned(),
        ));
    }
    if let Some(removed) = removed {
        return Err(Refusal::Conflict(format!(
            "{target} was removed already, on {} by {}; `devctl admin user restore '{target}'` \
             re-admits them",
            utc(removed.at),
            removed.by
        )));
    }
    if let Some(job) = jobs.iter().find(|j| j.state() == JobState::Halting) {
        return Err(Refusal::Conflict(format!(
            "job {} of {target} is HALTING: it ends within {} seconds; remove the user then",
            job.id,
            HALT_GRACE.as_secs()
        )));
    }
    if force {
        return Ok(());
    }
    let live: Vec<String> = sessions
        .iter()
        .filter(|s| s.owner == *target && s.state != SessionState::Ended)
        .map(|s| format!("session {} ({})", s.name, s.state))
        .chain(
            jobs.iter()
                .filter(|j| j.owner == *target && runs(j.state()))
                .map(|j| format!("job {} ({})", j.id, j.state())),
        )
        .collect();
    if live.is_empty() {
        return Ok(());
    }
    Err(Refusal::Conflict(format!(
        "{target} still has {}: end them first, or remove the user with --force, which ends \
         their sessions and cancels their jobs",
        live.join(", ")
    )))
}

/// A job that runs or is told to halt: cancelling it kills it.
fn runs(state: JobState) -> bool {
    matches!(state, JobState::Running | JobState::MustHalt)
}

/// What removing a user does to what they have, once they are marked removed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Removal {
    /// Their sessions that have not ended, and the change that ends each.
    pub sessions: Vec<(SessionId, Change)>,
    /// Their queued and running jobs, and the change that cancels each.
    pub jobs: Vec<(JobId, JobChange)>,
    /// Their images that are not DELETED, to remove.
    pub images: Vec<uuid::Uuid>,
}

/// What removing a user by `by` at `now` does to their `sessions`, `jobs` and `images` (as
/// listed after they were marked removed, so nothing they started meanwhile is left): every
/// session that has not ended is ENDED, every queued or running job CANCELLED, every image
/// that is not DELETED removed. Jobs that are HALTING or ended are left as they are.
pub fn removal(
    by: &UserName,
    sessions: &[SessionRecord],
    jobs: &[JobRecord],
    images: &[ImageRecord],
    now: DateTime<Utc>,
) -> Removal {
    Removal {
        sessions: sessions
            .iter()
            .filter(|s| s.state != SessionState::Ended)
            .map(|s| (s.id, requests::remove(by, now)))
            .collect(),
        jobs: jobs
            .iter()
            .filter_map(|job| {
                let change = match job.state() {
                    JobState::Queued => jobs::cancel_queued(job, JobReason::CancelledByUser, now),
                    state if runs(state) => jobs::cancel_by_owner(job, now),
                    _ => return None,
                };
                change.ok().map(|change| (job.id, change))
            })
            .collect(),
        images: images
            .iter()
            .filter(|i| super::images::delete(i, now).is_some())
            .map(|i| i.id)
            .collect(),
    }
}

impl Removal {
    /// What it does, for the user's history: `keys` is how many keys were deleted.
    pub fn summary(&self, keys: usize) -> String {
        let mut text = String::new();
        let _ = write!(
            text,
            "{keys} key(s) deleted, {} session(s) ended, {} job(s) cancelled, {} image(s) removed",
            self.sessions.len(),
            self.jobs.len(),
            self.images.len()
        );
        text
    }
}

/// Checks that `target` may be restored: only a removed user.
pub fn check_restore(target: &Dn, removed: Option<&Removed>) -> Result<(), Refusal> {
    match removed {
        Some(_) => Ok(()),
        None => Err(Refusal::Conflict(format!(
            "{target} is not removed: nothing to restore"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use ongrid_core::image::{ImageReference, ImageState};
    use ongrid_core::job::{JobImage, JobLifecycle, JobSpecFile, RestartChain};
    use ongrid_core::SessionName;

    use super::super::sessions::fixtures::session;
    use super::*;
    use crate::domain::fixtures::{alice, t};

    fn admin() -> Dn {
        Dn::parse("/CN=Admin").unwrap()
    }

    fn job(n: u128, state: JobState) -> JobRecord {
        let id = JobId(uuid::Uuid::from_u128(n));
        let spec = JobSpecFile {
            image: Some("model:v1".into()),
            command: vec!["python".into(), "train.py".into()],
            ..JobSpecFile::default()
        }
        .validate(t(0))
        .unwrap();
        let mut lifecycle = JobLifecycle::new(t(0), JobReason::Submitted);
        let path: &[JobState] = match state {
            JobState::Queued => &[],
            JobState::Running => &[JobState::Running],
            JobState::MustHalt => &[JobState::Running, JobState::MustHalt],
            JobState::Halting => &[JobState::Running, JobState::MustHalt, JobState::Halting],
            JobState::Finished => &[JobState::Running, JobState::Finished],
            other => panic!("no path to {other} in this test"),
        };
        for (i, &to) in path.iter().enumerate() {
            let at = t(i64::try_from(i).unwrap() + 1);
            lifecycle
                .transition(to, at, JobReason::HaltSignalSent)
                .unwrap();
        }
        JobRecord {
            id,
            owner: alice(),
            user_name: UserName::parse("alice").unwrap(),
            uid: 20_000,
            spec,
            lifecycle,
            max_duration: None,
            image: JobImage {
                digest: format!("sha256:{}", "a".repeat(64)),
                docker_image: "ongrid/alice/model:v1".into(),
            },
            node: None,
            pinned_node: None,
            gpus: vec![],
            chain: RestartChain::first(id),
            previous_job: None,
            next_job: None,
            exit_code: None,
            log_size: 0,
            log_complete: false,
            grid: None,
        }
    }

    fn image(n: u128, state: ImageState) -> ImageRecord {
        ImageRecord {
            id: uuid::Uuid::from_u128(n),
            reference: ImageReference::parse("model:v1").unwrap(),
            state,
            session_name: SessionName::parse("dev").unwrap(),
            ..super::super::images::fixtures::image()
        }
    }

    #[test]
    fn a_removed_user_is_refused_with_how_to_come_back() {
        assert_eq!(admission(&alice(), None), Ok(()));
        let removed = Removed {
            at: t(0),
            by: admin(),
        };
        let Err(Refusal::Forbidden(message)) = admission(&alice(), Some(&removed)) else {
            panic!("a removed user must be refused with 403");
        };
        assert!(
            message.contains("an admin (/CN=Admin) removed your account"),
            "{message}"
        );
        assert!(
            message.contains("`devctl admin user restore '/CN=Alice'`"),
            "{message}"
        );
    }

    #[test]
    fn live_sessions_and_running_jobs_refuse_a_removal_unless_forced() {
        let ended = session("old", SessionState::Ended);
        let held = session("train1", SessionState::Held);
        let queued = job(1, JobState::Queued);
        let running = job(2, JobState::Running);
        let check = |sessions: &[SessionRecord], jobs: &[JobRecord], force| {
            check_removal(&alice(), None, &admin(), sessions, jobs, force)
        };
        // Ended sessions and queued jobs do not stand in the way.
        assert_eq!(
            check(
                std::slice::from_ref(&ended),
                std::slice::from_ref(&queued),
                false
            ),
            Ok(())
        );
        let Err(Refusal::Conflict(message)) = check(&[ended.clone(), held.clone()], &[], false)
        else {
            panic!("a HELD session must refuse an unforced removal");
        };
        assert!(message.contains("session train1 (HELD)"), "{message}");
        assert!(message.contains("--force"), "{message}");
        assert!(!message.contains("session old"), "{message}");
        let Err(Refusal::Conflict(message)) = check(&[], std::slice::from_ref(&running), false)
        else {
            panic!("a RUNNING job must refuse an unforced removal");
        };
        assert!(message.contains("(RUNNING)"), "{message}");
        assert_eq!(check(&[held], &[running], true), Ok(()));
        // A halting job refuses even a forced removal.
        let halting = job(3, JobState::Halting);
        assert!(matches!(
            check(&[], &[halting], true),
            Err(Refusal::Conflict(m)) if m.contains("HALTING")
        ));
    }

    #[test]
    fn nobody_removes_themselves_or_a_removed_user() {
        assert!(matches!(
            check_removal(&admin(), None, &admin(), &[], &[], true),
            Err(Refusal::Conflict(m)) if m.contains("cannot remove yourself")
        ));
        let removed = Removed {
            at: t(0),
            by: admin(),
        };
        assert!(matches!(
            check_removal(&alice(), Some(&removed), &admin(), &[], &[], true),
            Err(Refusal::Conflict(m)) if m.contains("removed already")
        ));
        assert_eq!(check_restore(&alice(), Some(&removed)), Ok(()));
        assert!(check_restore(&alice(), None).is_err());
    }

    #[test]
    fn a_removal_ends_sessions_cancels_jobs_and_removes_images() {
        let by = UserName::parse("admin").unwrap();
        let sessions = [
            session("old", SessionState::Ended),
            session("train1", SessionState::Connected),
            session("train2", SessionState::Pending),
        ];
        let jobs = [
            job(1, JobState::Queued),
            job(2, JobState::Running),
            job(3, JobState::MustHalt),
            job(4, JobState::Finished),
            job(5, JobState::Halting),
        ];
        let images = [
            image(1, ImageState::Ready),
            image(2, ImageState::Building),
            image(3, ImageState::Deleted),
        ];
        let removal = removal(&by, &sessions, &jobs, &images, t(100));
        let ended: Vec<SessionId> = removal.sessions.iter().map(|(id, _)| *id).collect();
        assert_eq!(ended, vec![sessions[1].id, sessions[2].id]);
        for (_, change) in &removal.sessions {
            assert_eq!(change.to, SessionState::Ended);
            assert_eq!(change.at, t(100));
            assert_eq!(change.reason, "removed by admin");
        }
        let cancelled: Vec<JobId> = removal.jobs.iter().map(|(id, _)| *id).collect();
        assert_eq!(cancelled, vec![jobs[0].id, jobs[1].id, jobs[2].id]);
        assert!(removal
            .jobs
            .iter()
            .all(|(_, c)| c.to == JobState::Cancelled && c.at == t(100)));
        assert_eq!(removal.images, vec![images[0].id, images[1].id]);
        assert_eq!(
            removal.summary(2),
            "2 key(s) deleted, 2 session(s) ended, 3 job(s) cancelled, 2 image(s) removed"
        );
    }
}
