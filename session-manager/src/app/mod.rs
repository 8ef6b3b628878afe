//! The application layer: each use case a person (or an agent, or the gateway) has of the
//! manager, written once, below the transports that translate requests and answers (`api/`
//! JSON, `dashboard/` HTML), which never import each other. A use case takes the
//! [`AppState`] and the caller ([`caller::CurrentUser`]), looks up what it acts on, checks who may
//! do it, asks [`crate::domain`] for the decision, writes it through the [`crate::store`], and says
//! what the write changed as [`Effect`]s; [`AppState::committed`] is the one place that turns
//! effects into wake-ups (the scheduler, the long-polls, the grid mirror, and through them the
//! other replicas).
//!
//! - [`sessions`]: create, hold, release, keep alive, remove; [`images`]: freeze a session;
//!   [`institutes`]: add, remove; [`jobs`]: submit, cancel, halt, remove; [`keys`]: SSH keys;
//!   [`nodes`]: drain and undrain nodes and GPUs, remove a node, a GPU's mode; [`logins`]: the
//!   dashboard's single-use login links; [`token_links`]: token identities linked to users;
//!   [`users`]: list, remove, restore; [`reservations`]: owned GPUs and reservations;
//!   [`web_apps`]: a session's web apps in the browser.
//! - For the other components: [`agent_sync`] (an agent's registration, sync and long-poll, with
//!   [`job_reports`] for its jobs) and [`gateway`] (the SSH gateway's allowlist, key checks,
//!   routing and connection events).
//! - Shared: [`caller`] (who asks), [`lookup`] (`{name}[?owner=DN]`, images, reservations),
//!   [`views`] (records as people see them, and what a view reads of the whole site once per
//!   answer) and [`error`] ([`ApiError`], the refusal every caller words the same).
//!
//! Refusals whose advice differs between a terminal and a page (a `devctl` command to run, or
//! a control of the page) come back as a variant of the use case's error, for each transport to
//! word; everything else (lookups, the domain's refusals, the store failing) is an [`ApiError`]
//! worded the same for both.

pub mod agent_sync;
pub mod caller;
pub mod error;
pub mod gateway;
pub mod images;
pub mod institutes;
pub mod job_reports;
pub mod jobs;
pub mod keys;
pub mod logins;
pub mod lookup;
pub mod nodes;
pub mod reservations;
pub mod sessions;
pub mod shared_read;
pub mod token_links;
pub mod users;
pub mod views;
pub mod web_apps;

use std::collections::HashMap;
use std::sync::Arc;

use ongrid_core::{NodeName, SessionId, SessionState};
use tokio::sync::Notify;

pub use error::ApiError;

use crate::auth::{AgentTokens, GatewayToken};
use crate::clock::Clock;
use crate::config::Config;
use crate::domain::sessions::SessionRecord;
use crate::site::SiteSnapshot;
use crate::store::{SessionFilter, Store};

/// What every handler shares.
#[derive(Clone)]
pub struct AppState {
    pub store: Arc<dyn Store>,
    pub config: Arc<Config>,
    pub tokens: Arc<AgentTokens>,
    /// `None` when the config has no `gateway_token_file`: gateway routes answer 401.
    pub gateway_token: Option<Arc<GatewayToken>>,
    /// Users' bearer tokens, from the issuers of `[[token_issuers]]`.
    pub bearer: Arc<crate::tokens::TokenVerifier>,
    pub clock: Arc<dyn Clock>,
    /// Wakes the scheduling loop.
    pub wake: Arc<Notify>,
    /// Runs a scheduling round in place, when an answer should reflect it.
    pub scheduler: Arc<crate::scheduling::Scheduler>,
    /// Whether this replica leads (runs the scheduler); see [`crate::replicas`].
    pub leader: crate::replicas::Leader,
    /// Wakes the long-polls of agents and people when a commit changed what they wait on.
    pub changes: crate::notify::Changes,
    /// The grid targets (Slurm, HTCondor): hands jobs over, mirrors their states.
    pub grid: Arc<crate::grid_mirror::GridMirror>,
    /// Sessions' web apps in the browser: the agent stream client, JupyterLab servers.
    pub web_apps: Arc<web_apps::WebApps>,
    /// The inventory read that requests arriving together share ([`Self::inventory`]).
    pub inventory_reads: Arc<shared_read::SharedRead<SiteSnapshot>>,
    /// What [`Self::inventory`]'s snapshots answer [`SiteSnapshot::never_meets`] from.
    pub satisfiability: Arc<crate::site::Satisfiability>,
    /// The version of each node's desired state as its long-poll last read it.
    pub desired_versions: Arc<agent_sync::DesiredVersions>,
}

impl AppState {
    /// The site as of now.
    pub async fn site(&self) -> Result<SiteSnapshot, ApiError> {
        Ok(SiteSnapshot::load(
            self.store.as_ref(),
            self.clock.now(),
            self.config.node_timeout,
        )
        .await?)
    }

    /// The site's nodes and GPUs as of now, without what holds them
    /// ([`SiteSnapshot::load_inventory`]): a read that started after this call, shared with
    /// the requests that asked for it at the same time (a burst of session requests reads the
    /// nodes and their GPUs once or twice, not once each).
    pub async fn inventory(&self) -> Result<Arc<SiteSnapshot>, ApiError> {
        self.inventory_reads
            .get(|| async {
                Ok(SiteSnapshot::load_inventory(
                    self.store.as_ref(),
                    self.clock.now(),
                    self.config.node_timeout,
                    &self.satisfiability,
                )
                .await?)
            })
            .await
    }

    /// Schedules now, so that an answer can say whether `session` got its GPUs (STARTING) or
    /// waits (PENDING): the leader starts a round (or shares one that starts after the commit
    /// with the requests beside it); a follower asks the leader for such a round
    /// ([`crate::notify::Remote::Covered`] answers). Either waits for it at most the config's
    /// `placement_wait`: a loaded site answers in time, PENDING with its place, while the round
    /// goes on and places it; a follower whose leader is gone answers too. A follower's wait
    /// holds two notices through the database besides the leader's round, so it answers PENDING
    /// more often. A failed round is retried by the loop.
    pub async fn schedule_now(&self, session: SessionId) {
        // Numbered before looking who leads: a replica taking the lead covers the asks numbered
        // by then (`replicas.rs`), and a request that asks later sees it lead and runs its own
        // round.
        let asked = self.changes.ask_round();
        if self.leader.is_leading() {
            self.scheduler.cover(asked, session);
        } else {
            self.wake.notify_one();
        }
        // Still PENDING after the wait: the answer says so; the round places it later.
        if tokio::time::timeout(self.config.placement_wait, self.changes.covered(asked))
            .await
            .is_err()
        {
            tracing::debug!(%session, "Answered PENDING before the round asked for ended.");
        }
    }

    /// `session`'s 1-based queue position ([`Self::queue_positions`]) when it is PENDING. Without
    /// fair share the store counts it, instead of every position being read for one.
    pub async fn queue_position(&self, session: &SessionRecord) -> Result<Option<u32>, ApiError> {
        if session.state != SessionState::Pending {
            return Ok(None);
        }
        if self.config.fair_share.is_none() {
            return Ok(self.store.pending_place(session.id).await?);
        }
        Ok(self.queue_positions().await?.get(&session.id).copied())
    }

    /// 1-based queue positions of the PENDING sessions, in the order the scheduler serves them
    /// (fair-share priority, then time queued).
    pub async fn queue_positions(&self) -> Result<HashMap<SessionId, u32>, ApiError> {
        let Some(fair_share) = &self.config.fair_share else {
            let order = self.store.pending_order().await?;
            return Ok(order.into_iter().zip(1u32..).collect());
        };
        let pending = self
            .store
            .sessions(SessionFilter::States(vec![SessionState::Pending]))
            .await?;
        let waiting: Vec<_> = pending
            .iter()
            .map(|s| (s.owner.clone(), s.queued_at, s.id))
            .collect();
        let accounts = self.store.usage_accounts().await?;
        let order =
            crate::scheduling::fair_share::serve_order(&waiting, &accounts, Some(fair_share));
        Ok(order.into_iter().zip(1u32..).collect())
    }
}

/// What a committed write changed, named by the waiters it concerns. A use case says it once,
/// through [`AppState::committed`], after its write committed; no handler or page wakes anyone
/// by hand. A waiter compares what it reads with what it had, so an effect said too often costs
/// one read, and one never said is caught by the periodic rounds and syncs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    /// The scheduler's input: a request queued or released, a job changed, a GPU drained or
    /// back, a reservation. Wakes the scheduling loop (on a replica that does not lead, the wake
    /// reaches the leader's through `crate::replicas`).
    Scheduling,
    /// What some node should run, or what a person's long-poll watches (a session's or a job's
    /// state): wakes the agents' and people's long-polls ([`crate::notify::Changes::site`]).
    Nodes,
    /// Something of one node's changed (its agent's report): wakes the long-polls of people
    /// waiting on its sessions and the node's own, which answers only if its desired state
    /// changed.
    Node(NodeName),
    /// What only people watch (a session's, job's or image's state, an institute, a
    /// reservation), but no node's desired state: wakes people's long-polls and the dashboard's
    /// live pages, not the agents' ([`crate::notify::Changes::sessions`]).
    People,
    /// A job of a grid target (Slurm, HTCondor) changed: the grid mirror acts on it now (a
    /// cancel reaches `scancel` or `condor_rm`) instead of at its next poll. The mirror runs on
    /// the leader, which a follower reaches through the scheduler's wake-up.
    GridJob,
}

impl AppState {
    /// The one place a committed write's [`Effect`]s become wake-ups.
    pub fn committed(&self, effects: &[Effect]) {
        for effect in effects {
            match effect {
                Effect::Scheduling => self.wake.notify_one(),
                Effect::Nodes => self.changes.site(),
                Effect::Node(node) => self.changes.node(node),
                Effect::People => self.changes.sessions(),
                Effect::GridJob => {
                    self.grid.wake();
                    self.wake.notify_one();
                }
            }
        }
    }
}

/// Where a person asked for an action, for the logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// The HTTPS API (`devctl`).
    Api,
    /// A form of the web dashboard.
    Dashboard,
}

impl Via {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Api => "api",
            Self::Dashboard => "dashboard",
        }
    }
}
