//! Sessions created together ([`super::together`]): the creates that arrive while a write
//! waits for the site's write lock are written in it, all of them, instead of one write each. A name
//! already taken or an owner removed refuses that one create, decided before anything of it is
//! written.

use std::collections::{BTreeSet, HashMap};

use ongrid_core::{Dn, Lifecycle, SessionName, SessionState};
use sqlx::{QueryBuilder, Transaction};

use super::together::{Lock, WriteQueue};
use super::{
    activity, first_free_name, history, parse, planning, timestamp, to_json, Db, SqlStore,
};
use crate::store::{NewSession, StoreError, StoreResult};

/// The creates waiting for a write.
pub type CreateQueue = WriteQueue<Creating>;

/// A session to create, with the name it was asked for or the default one free when looked for.
#[derive(Debug)]
pub struct Creating {
    new: NewSession,
    name: SessionName,
    asked: bool,
}

impl SqlStore {
    /// Creates `new`, in the write of every create waiting with it, and reads it back.
    pub(super) async fn create_session(
        &self,
        new: NewSession,
    ) -> StoreResult<super::SessionRecord> {
        // The default name is looked for before the write, whose lock every write of the site
        // queues for, and only checked inside it: taken meanwhile, it is looked for again there.
        // So it is the first name free when it was looked for: one that a session of the owner
        // gives up between the two is left for the next create.
        let (name, asked) = match &new.name {
            Some(name) => (name.clone(), true),
            None => (first_free_name(&self.pool, &new.owner).await?, false),
        };
        let id = new.id;
        let creating = Creating { new, name, asked };
        self.creates
            .write(self, creating, Lock::Site, |store, tx, creates| {
                Box::pin(store.write_creates(tx, creates))
            })
            .await?;
        self.session(id).await?.ok_or(StoreError::NoSuchSession(id))
    }

    /// Writes `creates` in the write transaction `tx`: each create's outcome in order, a
    /// refusal (its owner removed, its asked name taken) decided before anything of it is
    /// written.
    async fn write_creates(
        &self,
        mut tx: Transaction<'static, Db>,
        creates: &[Creating],
    ) -> StoreResult<Vec<StoreResult<()>>> {
        let owners: BTreeSet<&Dn> = creates.iter().map(|c| &c.new.owner).collect();
        let removed = super::removed_among(&mut tx, &owners).await?;
        let mut taken = live_names(&mut tx, creates).await?;
        let mut change = planning::Stamp::default();
        let mut unwritten: Vec<(&Creating, SessionName)> = Vec::new();
        let mut rows = history::NewRows::default();
        let mut limits = Vec::new();
        let mut outcomes = Vec::with_capacity(creates.len());
        for create in creates {
            let owner = &create.new.owner;
            if removed.contains(owner) {
                outcomes.push(Err(StoreError::UserRemoved(owner.clone())));
                continue;
            }
            let name = match taken.get(&(owner.clone(), create.name.clone())) {
                None => create.name.clone(),
                Some(&state) if create.asked => {
                    let name = create.name.clone();
                    outcomes.push(Err(StoreError::NameTaken { name, state }));
                    continue;
                }
                // Counted again with the sessions of this write stored.
                Some(_) => {
                    insert_sessions(&mut tx, &mut unwritten, &mut change).await?;
                    first_free_name(&mut *tx, owner).await?
                }
            };
            taken.insert((owner.clone(), name.clone()), SessionState::Pending);
            unwritten.push((create, name));
            let new = &create.new;
            let lifecycle = Lifecycle::new(new.at, new.reason.clone());
            let first = lifecycle.last();
            rows.push(new.id, 0, first, (&first.reason, None))?;
            if new.idle_timeout_secs.is_some() || new.max_duration_secs.is_some() {
                limits.push((new.id, new.idle_timeout_secs, new.max_duration_secs));
            }
            outcomes.push(Ok(()));
        }
        insert_sessions(&mut tx, &mut unwritten, &mut change).await?;
        rows.insert(&mut tx).await?;
        activity::insert_limits(&mut tx, &limits).await?;
        tx.commit().await?;
        Ok(outcomes)
    }
}

/// The sessions not ended among the owners and names of `creates`, by owner and name.
async fn live_names(
    tx: &mut Transaction<'static, Db>,
    creates: &[Creating],
) -> StoreResult<HashMap<(Dn, SessionName), SessionState>> {
    let owners: BTreeSet<&str> = creates.iter().map(|c| c.new.owner.as_str()).collect();
    let names: BTreeSet<&str> = creates.iter().map(|c| c.name.as_str()).collect();
    let mut query = QueryBuilder::<Db>::new(
        "SELECT owner, name, state FROM sessions WHERE state <> 'ENDED' AND owner IN (",
    );
    let mut listed = query.separated(", ");
    for owner in owners {
        listed.push_bind(owner);
    }
    query.push(") AND name IN (");
    let mut listed = query.separated(", ");
    for name in names {
        listed.push_bind(name);
    }
    query.push(")");
    let rows: Vec<(String, String, String)> = query
        .build_query_as()
        .persistent(false)
        .fetch_all(&mut **tx)
        .await?;
    rows.iter()
        .map(|(owner, name, state)| {
            let owner = Dn::parse(owner)
                .map_err(|e| StoreError::Corrupt(format!("stored session owner: {e}")))?;
            let name = SessionName::parse(name)
                .map_err(|e| StoreError::Corrupt(format!("stored session name: {e}")))?;
            Ok(((owner, name), parse(state, "session state")?))
        })
        .collect()
}

/// Inserts the sessions of `unwritten` (PENDING, stamped with the write's change number) and
/// empties it.
async fn insert_sessions(
    tx: &mut Transaction<'static, Db>,
    unwritten: &mut Vec<(&Creating, SessionName)>,
    change: &mut planning::Stamp,
) -> StoreResult<()> {
    if unwritten.is_empty() {
        return Ok(());
    }
    let change = change.get(tx).await?;
    let mut values = Vec::with_capacity(unwritten.len());
    for (create, name) in unwritten.iter() {
        values.push((&create.new, name, to_json(&create.new.request)?));
    }
    let mut query = QueryBuilder::<Db>::new(
        "INSERT INTO sessions (id, name, owner, request, image, state, reason, gpus, \
         created_at, queued_at, change_seq) ",
    );
    query.push_values(&values, |mut row, (new, name, request)| {
        row.push_bind(new.id.to_string())
            .push_bind(name.as_str())
            .push_bind(new.owner.as_str())
            .push_bind(request.as_str())
            .push_bind(new.image.as_str())
            .push_bind(SessionState::Pending.as_str())
            .push_bind(new.reason.as_str())
            .push_bind("[]")
            .push_bind(timestamp(new.at))
            .push_bind(timestamp(new.at))
            .push_bind(change);
    });
    // Its text changes with the number of rows: not kept among the connection's prepared
    // statements, where it would push out the ones every request runs.
    query.build().persistent(false).execute(&mut **tx).await?;
    unwritten.clear();
    Ok(())
}
