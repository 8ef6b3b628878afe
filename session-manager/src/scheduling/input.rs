//! Phase 5 of a round: what the plan is given. The queue of PENDING sessions (a released
//! session pinned to its node while that node is online, a session waiting for jobs to halt
//! with its [`HaltWait`]), ordered by fair share, without the requests a limit holds back, and
//! with the policy of owned GPUs and reservations.

use std::collections::HashMap;

use ongrid_core::{NodeName, SessionId};
use ongrid_scheduler::{HaltWait, SiteState};

use super::gpu_policy::PolicySettings;
use super::{fair_share, limits, Reads, Round, Scheduler};
use crate::domain::policy::fairshare;
use crate::site::pending_session;
use crate::store::StoreResult;

/// Released sessions whose node is offline or gone, by the node they leave: they start
/// anywhere, and their placement says so.
pub(super) type Unpinned = HashMap<SessionId, NodeName>;

impl Scheduler {
    /// The plan's input for this round, and the sessions that lost their pin.
    pub(super) async fn plan_input(
        &self,
        round: &Round<'_>,
        halt_waits: &HashMap<SessionId, HaltWait>,
        reads: &mut Reads<'_>,
    ) -> StoreResult<(SiteState, Unpinned)> {
        let (mut state, unpinned) = queue(round, halt_waits);
        if let Some(config) = &self.fair_share {
            let accounts = reads.accounts().await?;
            let standings = fairshare::standings(accounts, config);
            fair_share::prioritise(
                &mut state,
                accounts,
                &standings,
                round.pending,
                &round.site.jobs,
            );
        }
        self.hold_back_over_limits(&mut state, round, reads).await?;
        if !round.gpu_policy.is_idle(round.now) {
            let settings = self.gpu_policy.unwrap_or(PolicySettings {
                sessions_on_owned_gpus: false,
                lifecycle: Default::default(),
            });
            let (accounts, facts) = reads.accounts_and_facts().await?;
            state.policy = round.gpu_policy.scheduler_policy(
                round.site,
                accounts,
                round.pending,
                facts,
                &settings,
                round.now,
            );
        }
        Ok((state, unpinned))
    }

    /// Takes out of `state` the requests over a `[limits]` maximum, and remembers why each
    /// waits (logged when that changes).
    async fn hold_back_over_limits(
        &self,
        state: &mut SiteState,
        round: &Round<'_>,
        reads: &mut Reads<'_>,
    ) -> StoreResult<()> {
        let Some(config) = &self.limits else {
            return Ok(());
        };
        let lifecycle = self.gpu_policy.map(|s| s.lifecycle).unwrap_or_default();
        let session_lengths = if config.length_classes.is_some() {
            limits::session_lengths(reads.facts().await?, &lifecycle)
        } else {
            HashMap::new()
        };
        let accounts = reads.accounts().await?;
        let limit_round = limits::Round {
            config,
            accounts,
            site: round.site,
            pending: round.pending,
            session_lengths: &session_lengths,
            lifecycle: &lifecycle,
        };
        let held_back = limits::hold_back(state, &limit_round);
        if let Ok(mut waits) = self.limit_waits.lock() {
            let mut now_waiting = HashMap::new();
            for (waiting, blocked) in held_back {
                let reason = blocked.to_string();
                if waits.get(&waiting) != Some(&reason) {
                    tracing::info!(?waiting, %reason, "Request waits for a limit.");
                }
                now_waiting.insert(waiting, reason);
            }
            *waits = now_waiting;
        }
        Ok(())
    }
}

/// The queue as the plan sees it: each PENDING session with the halt it waits for, pinned to
/// the node of its stopped container while that node is online.
fn queue(round: &Round<'_>, halt_waits: &HashMap<SessionId, HaltWait>) -> (SiteState, Unpinned) {
    let site = round.site;
    let mut unpinned = Unpinned::new();
    let queue = round
        .pending
        .iter()
        .map(|session| {
            let mut queued = pending_session(session);
            queued.awaiting_halt = halt_waits.get(&session.id).cloned();
            if let Some(node) = &session.node {
                let online = site
                    .nodes
                    .iter()
                    .any(|n| n.name == *node && site.is_online(n));
                if online {
                    queued.pinned_node = Some(node.clone());
                    queued.previous_gpus = ongrid_core::api::whole_gpus(&session.gpus);
                } else {
                    unpinned.insert(session.id, node.clone());
                }
            }
            queued
        })
        .collect();
    (site.scheduler_state(queue), unpinned)
}
