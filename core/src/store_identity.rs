//! Which copy of the store a manager serves: the store's id (random, made with the store) and
//! its generation (raised by `ongrid-manager copy-store` and `ongrid-manager mark-restored`).
//! Every answer of a manager carries it in [`STORE_HEADER`] as `<id>.<generation>`; a client of
//! several managers remembers the highest generation it saw and refuses a manager answering
//! with a lower one, or with another store's id ([`Seen::judge`]): that manager was left on an
//! old copy of the database after a restore. A client tells the managers what it saw in
//! [`SEEN_HEADER`], so a manager left behind learns it and stops leading.

use std::fmt;
use std::str::FromStr;

/// The response header naming the store a manager serves: `<id>.<generation>`.
pub const STORE_HEADER: &str = "ongrid-store";

/// The request header with the newest store a client saw: `<id>.<generation>`.
pub const SEEN_HEADER: &str = "ongrid-store-seen";

/// One copy of a store: its id and generation.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct StoreIdentity {
    /// Lower-case hex, made at random with the store and kept by its copies.
    pub id: String,
    /// 1 for a new store, one more at each copy or restore.
    pub generation: u64,
}

/// Why a header is not a [`StoreIdentity`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a store identity (<hex id>.<generation>)")]
pub struct BadStoreIdentity(String);

impl fmt::Display for StoreIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.id, self.generation)
    }
}

impl FromStr for StoreIdentity {
    type Err = BadStoreIdentity;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let bad = || BadStoreIdentity(text.chars().take(80).collect());
        let (id, generation) = text.rsplit_once('.').ok_or_else(bad)?;
        let hex = |c: char| c.is_ascii_digit() || ('a'..='f').contains(&c);
        if id.is_empty() || id.len() > 64 || !id.chars().all(hex) {
            return Err(bad());
        }
        if generation.is_empty() || !generation.chars().all(|c| c.is_ascii_digit()) {
            return Err(bad());
        }
        Ok(Self {
            id: id.to_owned(),
            generation: generation.parse().map_err(|_| bad())?,
        })
    }
}

/// The newest store a client saw answering, if any.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Seen(Option<StoreIdentity>);

/// A manager's answer that [`Seen::judge`] refuses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refused {
    /// The same store, a lower generation: an older copy.
    Older {
        served: StoreIdentity,
        seen: StoreIdentity,
    },
    /// Another store altogether.
    Other {
        served: StoreIdentity,
        seen: StoreIdentity,
    },
}

impl Refused {
    /// What happened and what to do, for the log and the user, naming the manager.
    pub fn explain(&self, manager: &str) -> String {
        match self {
            Self::Older { served, seen } => format!(
                "manager {manager} serves an older copy of the store (generation {}, others \
                 serve {}): its `database` setting was missed after a restore; fix its \
                 manager.toml and restart it",
                served.generation, seen.generation
            ),
            Self::Other { served, seen } => format!(
                "manager {manager} serves another store (id {}, others serve {}): its \
                 `database` names another database than the other managers'; fix its \
                 manager.toml and restart it",
                served.id, seen.id
            ),
        }
    }
}

impl Seen {
    /// The newest store seen, if any.
    pub fn newest(&self) -> Option<&StoreIdentity> {
        self.0.as_ref()
    }

    /// Judges a manager's answer serving `served`: refused when it is an older copy of the store
    /// seen, or another store; else remembered when newer.
    pub fn judge(&mut self, served: &StoreIdentity) -> Result<(), Refused> {
        match &self.0 {
            Some(seen) if seen.id != served.id => Err(Refused::Other {
                served: served.clone(),
                seen: seen.clone(),
            }),
            Some(seen) if served.generation < seen.generation => Err(Refused::Older {
                served: served.clone(),
                seen: seen.clone(),
            }),
            _ => {
                self.0 = Some(served.clone());
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn identity(id: &str, generation: u64) -> StoreIdentity {
        StoreIdentity {
            id: id.to_owned(),
            generation,
        }
    }

    #[test]
    fn a_header_is_the_id_and_the_generation() {
        let parsed: StoreIdentity = "0a1b.3".parse().unwrap();
        assert_eq!(parsed, identity("0a1b", 3));
        assert_eq!(parsed.to_string(), "0a1b.3");
        for bad in [
            "", "0a1b", ".3", "0a1b.", "0A1B.3", "xyz.3", "0a1b.-3", "0a1b.3.4",
        ] {
            assert!(bad.parse::<StoreIdentity>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn an_older_copy_or_another_store_is_refused_and_a_newer_one_remembered() {
        let mut seen = Seen::default();
        assert_eq!(seen.judge(&identity("aa", 2)), Ok(()));
        assert_eq!(seen.judge(&identity("aa", 2)), Ok(()));
        let err = seen.judge(&identity("aa", 1)).unwrap_err();
        assert_eq!(
            err.explain("https://m2:8443/"),
            "manager https://m2:8443/ serves an older copy of the store (generation 1, others \
             serve 2): its `database` setting was missed after a restore; fix its manager.toml \
             and restart it"
        );
        let err = seen.judge(&identity("bb", 5)).unwrap_err();
        assert!(matches!(err, Refused::Other { .. }), "{err:?}");
        assert!(err
            .explain("m")
            .contains("serves another store (id bb, others serve aa)"));
        assert_eq!(seen.judge(&identity("aa", 3)), Ok(()));
        assert_eq!(seen.newest(), Some(&identity("aa", 3)));
        assert!(seen.judge(&identity("aa", 2)).is_err());
    }

    proptest! {
        #[test]
        fn a_header_reads_back(id in "[0-9a-f]{1,64}", generation in any::<u64>()) {
            let written = identity(&id, generation);
            prop_assert_eq!(written.to_string().parse::<StoreIdentity>(), Ok(written));
        }

        #[test]
        fn parsing_any_text_never_panics(text in "\\PC{0,80}") {
            let _ = text.parse::<StoreIdentity>();
        }
    }
}
