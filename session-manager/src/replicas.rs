//! Several manager replicas on one PostgreSQL database: every replica serves the API (sessions,
//! jobs, agents' syncs, the gateway's calls), one of them, the leader, also runs the loops that
//! decide on their own ([`LeaderLoops`]: scheduling rounds with fair-share metering, the hold
//! timer, the freeze watch, the grid mirror, the retention's prune).
//!
//! The leader is the replica holding the database's manager lock
//! ([`crate::store::postgres::active`]); the others wait for it and the first to get it leads,
//! after [`TAKEOVER_GRACE`](crate::store::postgres::active::TAKEOVER_GRACE). A leader that loses
//! its lock connection stops its loops at once (a round in progress is dropped, its uncommitted
//! transaction rolled back), goes on serving the API and waits to lead again. [`Leader`] tells
//! the API and the scheduler whether this replica leads: a follower's scheduler places nothing.
//!
//! The replicas tell each other over PostgreSQL's LISTEN/NOTIFY ([`publish`], [`listen`]): each
//! change notification ([`crate::notify`]) so long-polls wake whichever replica committed, and a
//! follower's wake-ups of the scheduler, which the leader acts on. A notification lost on the way
//! (a dropped listening connection) is caught by the agents' periodic sync and the loops'
//! periodic rounds, as within one manager.
//!
//! A replica that a client showed to serve an old copy of the store ([`ServedStore`]: its
//! `database` was missed after a restore) stops leading and never leads again: it would lead
//! that old copy alone.
//!
//! With SQLite there is one manager and it always leads ([`Leader::sole`]), unless it serves an
//! old copy.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::freeze_watch::FreezeWatch;
use crate::grid_mirror::GridMirror;
use crate::hold_timer::HoldTimer;
use crate::retention::Retention;
pub use crate::scheduling::Leader;
use crate::scheduling::Scheduler;
use crate::served_store::ServedStore;

/// The loops only the leader runs.
pub struct LeaderLoops {
    pub scheduler: Arc<Scheduler>,
    pub schedule_interval: Duration,
    pub holds: Arc<HoldTimer>,
    pub freezes: Arc<FreezeWatch>,
    pub grid: Arc<GridMirror>,
    pub retention: Arc<Retention>,
}

impl LeaderLoops {
    /// Runs every loop until `term` is cancelled or this manager is found to serve an old
    /// copy of the store, then drops them where they are: the one manager of a SQLite store.
    pub async fn run_sole(&self, served: Arc<ServedStore>, term: CancellationToken) {
        tokio::select! {
            () = self.run(term.clone()) => {}
            () = served.left_behind() => {}
        }
    }

    /// Runs every loop until `term` is cancelled, then drops them where they are.
    pub async fn run(&self, term: CancellationToken) {
        let loops = async {
            tokio::join!(
                self.scheduler
                    .clone()
                    .run(self.schedule_interval, term.clone()),
                self.holds.clone().run(term.clone()),
                self.freezes.clone().run(term.clone()),
                self.grid.clone().run(term.clone()),
                self.retention.clone().run(term.clone()),
            )
        };
        tokio::select! {
            () = term.cancelled() => {}
            _ = loops => {}
        }
    }
}

#[cfg(feature = "postgres")]
pub use postgres::{lead, listen, publish, Wakes};

#[cfg(feature = "postgres")]
mod postgres {
    use std::collections::HashMap;

    use tokio::sync::{mpsc, watch, Notify};

    use super::*;
    use crate::notify::{Changed, Changes, Remote};
    use crate::store::postgres::active::TAKEOVER_GRACE;
    use crate::store::PostgresStore;

    /// How long to wait before trying again after the database refused a connection.
    const RETRY: Duration = Duration::from_secs(1);

    /// At most this many notifications in one NOTIFY statement.
    const BATCH: usize = 64;

    /// Waits for the manager lock, leads while holding it, and waits again after losing it,
    /// until `shutdown`, or until `served` is behind: then it never leads again. `lead` says
    /// whether this replica leads at each moment.
    pub async fn lead(
        store: PostgresStore,
        lead: watch::Sender<bool>,
        loops: LeaderLoops,
        served: Arc<ServedStore>,
        shutdown: CancellationToken,
    ) {
        let behind = served.behind();
        loop {
            if *behind.borrow() {
                shutdown.cancelled().await;
                return;
            }
            let lock = tokio::select! {
                lock = store.activate(|| tracing::info!(
                    "Follower: another replica leads; this one serves the API and leads when \
                     that one stops."
                )) => lock,
                () = served.left_behind() => continue,
                () = shutdown.cancelled() => return,
            };
            let mut lock = match lock {
                Ok(lock) => lock,
                Err(error) => {
                    tracing::error!(%error, "Could not wait for the manager lock; trying again.");
                    if sleep_or_shutdown(RETRY, &shutdown).await {
                        return;
                    }
                    continue;
                }
            };
            // A leader that lost its lock connection a moment ago may still be in a round.
            let lost = tokio::select! {
                () = tokio::time::sleep(TAKEOVER_GRACE) => None,
                why = lock.lost() => Some(why),
                () = served.left_behind() => continue,
                () = shutdown.cancelled() => return,
            };
            let lost = match lost {
                Some(why) => Some(why),
                None => {
                    tracing::info!("Leading: this replica runs the scheduler and the timers.");
                    lead.send_replace(true);
                    let term = shutdown.child_token();
                    let lost = tokio::select! {
                        why = lock.lost() => Some(why),
                        () = loops.run(term.clone()) => None,
                        () = served.left_behind() => Some(String::new()),
                    };
                    lead.send_replace(false);
                    term.cancel();
                    lost
                }
            };
            drop(lock);
            match lost {
                // Said in an ERROR already (`ServedStore`).
                Some(_) if *behind.borrow() => {}
                Some(why) => tracing::error!(%why,
                    "Lost the manager lock: stopped scheduling; serving the API and waiting to \
                     lead again."),
                None => return,
            }
        }
    }

    /// Where the wake-ups of the scheduler go on a replica: `api` is what the API and the hold
    /// timer notify, `scheduler` what the scheduling loop waits on.
    pub struct Wakes {
        pub api: Arc<Notify>,
        pub scheduler: Arc<Notify>,
        pub grid: Arc<GridMirror>,
        /// Runs the rounds that answer the followers' wakes while this replica leads ([`cover`]).
        pub rounds: Arc<Scheduler>,
    }

    /// Tells the other replicas what `outbox` gets from `changes`, and the API's wake-ups of
    /// the scheduler while this replica does not lead (the leader wakes its own), until
    /// `shutdown`.
    pub async fn publish(
        store: PostgresStore,
        replica: String,
        changes: Changes,
        mut outbox: mpsc::Receiver<Changed>,
        wakes: Arc<Wakes>,
        leader: Leader,
        shutdown: CancellationToken,
    ) {
        loop {
            let mut batch = Vec::new();
            tokio::select! {
                () = shutdown.cancelled() => return,
                Some(changed) = outbox.recv() => batch.push(Remote::Changed(changed)),
                () = wakes.api.notified() => {
                    if leader.is_leading() {
                        wakes.scheduler.notify_one();
                        continue;
                    }
                    batch.push(Remote::Wake(changes.rounds_asked()));
                }
            }
            while batch.len() < BATCH {
                match outbox.try_recv() {
                    Ok(changed) => batch.push(Remote::Changed(changed)),
                    Err(_) => break,
                }
            }
            if changes.take_overflow() {
                batch.push(Remote::Changed(Changed::Site));
            }
            let mut payloads: Vec<String> = batch.iter().map(|r| r.encode(&replica)).collect();
            payloads.sort();
            payloads.dedup();
            if let Err(error) = store.publish(&payloads).await {
                tracing::warn!(%error, "Could not tell the other replicas of a change; their \
                    long-polls see it at the agents' next periodic sync.");
            }
        }
    }

    /// Delivers what the other replicas publish to `changes`, and their wake-ups to this
    /// replica's scheduler and grid mirror while it leads, until `shutdown`. Each time this
    /// replica takes the lead it says so ([`Remote::Leading`]) and covers its own requests that
    /// asked while it followed; a follower that hears another say so, or listens anew, asks
    /// again for its requests still waiting (their wakes may have gone unheard).
    pub async fn listen(
        store: PostgresStore,
        replica: String,
        changes: Changes,
        wakes: Arc<Wakes>,
        leader: Leader,
        shutdown: CancellationToken,
    ) {
        let (asks, asked) = mpsc::unbounded_channel();
        let covering = cover(
            store.clone(),
            replica.clone(),
            changes.clone(),
            wakes.rounds.clone(),
            leader.clone(),
            asked,
            shutdown.clone(),
        );
        // Each time this replica takes the lead (again each time it changes, however quickly:
        // every takeover is said).
        let taking_over = async {
            let mut lead = leader.clone();
            loop {
                if lead.is_leading() {
                    if let Err(error) = store.publish(&[Remote::Leading.encode(&replica)]).await {
                        tracing::warn!(%error, "Could not tell the other replicas this one leads; \
                            their requests waiting for a round answer at their wait's end.");
                    }
                    if changes.awaits_round() {
                        let _ = asks.send((replica.clone(), changes.rounds_asked()));
                    }
                }
                tokio::select! {
                    () = lead.changed() => {}
                    () = shutdown.cancelled() => return,
                }
            }
        };
        // A wake of this follower's may have gone unheard (a takeover): send another for its
        // requests still waiting.
        let ask_again = || {
            if !leader.is_leading() && changes.awaits_round() {
                wakes.api.notify_one();
            }
        };
        // What was published while this replica did not hear it: a change of anything, and
        // perhaps a takeover.
        let look_again = || {
            changes.deliver(Changed::Site);
            ask_again();
        };
        // Until `shutdown`, which ends all three.
        let listening = async {
            loop {
                let listener = tokio::select! {
                    listener = store.listen() => listener,
                    () = shutdown.cancelled() => return,
                };
                let mut listener = match listener {
                    Ok(listener) => listener,
                    Err(error) => {
                        tracing::warn!(%error, "Could not listen to the other replicas; trying \
                        again.");
                        if sleep_or_shutdown(RETRY, &shutdown).await {
                            return;
                        }
                        continue;
                    }
                };
                look_again();
                loop {
                    let payload = tokio::select! {
                        payload = listener.recv() => payload,
                        () = shutdown.cancelled() => return,
                    };
                    match payload {
                        Ok(Some(payload)) => match Remote::decode(&payload) {
                            Some((from, _)) if from == replica => {}
                            Some((_, Remote::Changed(changed))) => changes.deliver(changed),
                            Some((from, Remote::Wake(asked))) => {
                                if leader.is_leading() {
                                    wakes.grid.wake();
                                    if asked == 0 {
                                        wakes.scheduler.notify_one();
                                    } else {
                                        // The round runs there, and answers.
                                        let _ = asks.send((from.to_owned(), asked));
                                    }
                                }
                            }
                            Some((_, Remote::Covered { replica: to, asked })) => {
                                if to == replica {
                                    changes.round_covered(asked);
                                }
                            }
                            Some((_, Remote::Leading)) => ask_again(),
                            None => {
                                tracing::warn!(%payload, "Ignored a notification no replica sends.")
                            }
                        },
                        Ok(None) => {
                            tracing::warn!(
                                "Lost the connection listening to the other replicas; \
                            listening again."
                            );
                            look_again();
                        }
                        Err(error) => {
                            tracing::warn!(%error, "Listening to the other replicas failed; trying \
                            again.");
                            break;
                        }
                    }
                }
                if sleep_or_shutdown(RETRY, &shutdown).await {
                    return;
                }
            }
        };
        tokio::join!(listening, covering, taking_over);
    }

    /// Answers the followers' wakes while this replica leads: a round that starts after they
    /// came (shared by those that came meanwhile), then a [`Remote::Covered`] to each follower
    /// with the highest of its numbers, so a request waiting there answers as soon as the round
    /// that could place it has ended, placed or not. This replica's own asks, made while it
    /// followed, are answered here, in `changes`. A round run after the lead was lost placed
    /// nothing and answers nobody: the next leader's [`Remote::Leading`] makes them ask again.
    async fn cover(
        store: PostgresStore,
        replica: String,
        changes: Changes,
        scheduler: Arc<Scheduler>,
        leader: Leader,
        mut asks: mpsc::UnboundedReceiver<(String, u64)>,
        shutdown: CancellationToken,
    ) {
        loop {
            let first = tokio::select! {
                ask = asks.recv() => match ask {
                    Some(ask) => ask,
                    None => return,
                },
                () = shutdown.cancelled() => return,
            };
            let mut highest = HashMap::from([first]);
            while let Ok((from, asked)) = asks.try_recv() {
                let kept = highest.entry(from).or_default();
                *kept = asked.max(*kept);
            }
            if let Err(error) = scheduler.tick_covering().await {
                tracing::error!(%error, "Scheduling for the other replicas failed; the loop retries.");
            }
            if !leader.is_leading() {
                continue;
            }
            if let Some(asked) = highest.remove(&replica) {
                changes.round_covered(asked);
                if highest.is_empty() {
                    continue;
                }
            }
            let payloads: Vec<String> = highest
                .into_iter()
                .map(|(to, asked)| Remote::Covered { replica: to, asked }.encode(&replica))
                .collect();
            if let Err(error) = store.publish(&payloads).await {
                tracing::warn!(%error, "Could not tell the other replicas a round ended; their \
                    requests answer at their wait's end.");
            }
        }
    }

    /// Sleeps `duration`; `true` when `shutdown` came first.
    async fn sleep_or_shutdown(duration: Duration, shutdown: &CancellationToken) -> bool {
        tokio::select! {
            () = tokio::time::sleep(duration) => false,
            () = shutdown.cancelled() => true,
        }
    }

    #[cfg(test)]
    mod tests {
        use std::time::Duration;

        use futures::FutureExt;

        use super::*;
        use crate::clock::SystemClock;
        use crate::job_logs::JobLogs;
        use crate::targets::{Targets, TargetsConfig};

        /// Long enough for any machine; a request that nobody covers waits for ever.
        const AT_MOST: Duration = Duration::from_secs(30);

        /// One replica's notifications and loops, on its own connections to the shared
        /// database; `lead` makes it lead; `heard` wakes first when its listener is up (it
        /// looks again at everything then).
        struct Replica {
            changes: Changes,
            wakes: Arc<Wakes>,
            lead: watch::Sender<bool>,
            heard: crate::notify::Waiter,
        }

        fn replica(
            store: &PostgresStore,
            name: &str,
            logs: &std::path::Path,
            shutdown: &CancellationToken,
        ) -> Replica {
            let (changes, outbox) = Changes::new(shutdown.clone()).with_outbox();
            let heard = changes.subscribe();
            let (lead, leader) = Leader::follower();
            let shared: Arc<dyn crate::store::Store> = Arc::new(store.clone());
            let clock: Arc<dyn crate::clock::Clock> = Arc::new(SystemClock);
            let scheduler_wake = Arc::new(Notify::new());
            let scheduler = Scheduler::new(
                shared.clone(),
                clock.clone(),
                Duration::from_secs(60),
                scheduler_wake.clone(),
            )
            .with_leader(leader.clone())
            .with_changes(changes.clone());
            let grid = GridMirror::new(
                shared,
                clock,
                Arc::new(Targets::from_config(&TargetsConfig::default())),
                Default::default(),
                JobLogs::new(logs.join(name)),
            );
            let wakes = Arc::new(Wakes {
                api: Arc::new(Notify::new()),
                scheduler: scheduler_wake,
                grid: Arc::new(grid),
                rounds: Arc::new(scheduler),
            });
            tokio::spawn(publish(
                store.clone(),
                name.to_owned(),
                changes.clone(),
                outbox,
                wakes.clone(),
                leader.clone(),
                shutdown.clone(),
            ));
            tokio::spawn(listen(
                store.clone(),
                name.to_owned(),
                changes.clone(),
                wakes.clone(),
                leader,
                shutdown.clone(),
            ));
            Replica {
                changes,
                wakes,
                lead,
                heard,
            }
        }

        /// Requests that asked for a round while no replica led (their wakes heard by nobody)
        /// are covered once one takes the lead: a follower's, which asks again when the new
        /// leader says it leads, and the new leader's own, made while it followed.
        #[tokio::test]
        async fn requests_waiting_while_no_replica_leads_are_covered_by_the_next_leader() {
            let url = crate::store::test_server::fresh_database().await;
            let logs = tempfile::tempdir().unwrap();
            let shutdown = CancellationToken::new();
            let store_a = PostgresStore::open(&url).await.unwrap();
            let store_b = PostgresStore::open(&url).await.unwrap();
            let mut spy = store_b.listen().await.unwrap();
            let mut b = replica(&store_b, "b", logs.path(), &shutdown);
            assert!(b.heard.changed().await);
            // b asks while no other replica exists: its wake is sent, and heard by nobody.
            let asked_b = b.changes.ask_round();
            b.wakes.api.notify_one();
            tokio::time::timeout(AT_MOST, async {
                while spy.recv().await.unwrap().as_deref() != Some("b wake 1") {}
            })
            .await
            .expect("b's wake is sent");
            let mut a = replica(&store_a, "a", logs.path(), &shutdown);
            assert!(a.heard.changed().await);
            // a asks while it follows; b, which does not lead either, lets its wake go.
            let asked_a = a.changes.ask_round();
            a.wakes.api.notify_one();
            assert_eq!(b.changes.covered(asked_b).now_or_never(), None);
            assert!(b.changes.awaits_round() && a.changes.awaits_round());

            a.lead.send_replace(true);
            tokio::time::timeout(AT_MOST, a.changes.covered(asked_a))
                .await
                .expect("the new leader covers its own request");
            tokio::time::timeout(AT_MOST, b.changes.covered(asked_b))
                .await
                .expect("the follower's request is covered once it asks the new leader again");
            assert!(!a.changes.awaits_round() && !b.changes.awaits_round());
            shutdown.cancel();
        }
    }
}
