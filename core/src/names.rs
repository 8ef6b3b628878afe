//! Names and identifiers parsed at the edge: session names, node names, user names, DNs, ids.
//!
//! Every constructor validates; the rest of the code only ever sees valid values. The names hold
//! their text in an `Arc<str>`: a clone (the scheduler's view of a site copies every node's name
//! each round) shares the text instead of copying it.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// Why a name was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    #[error("{kind} must not be empty")]
    Empty { kind: &'static str },
    #[error("{kind} {value:?} is longer than {max} characters")]
    TooLong {
        kind: &'static str,
        value: String,
        max: usize,
    },
    #[error("{kind} {value:?} may only contain {allowed}")]
    BadCharacter {
        kind: &'static str,
        value: String,
        allowed: &'static str,
    },
    #[error("{kind} {value:?} must start and end with a letter or digit")]
    BadEdge { kind: &'static str, value: String },
}

/// Checks a lower-case DNS label: `[a-z0-9]([a-z0-9-]*[a-z0-9])?`, 1 to `max` characters.
fn check_dns_label(kind: &'static str, value: &str, max: usize) -> Result<(), NameError> {
    if value.is_empty() {
        return Err(NameError::Empty { kind });
    }
    if value.len() > max {
        return Err(NameError::TooLong {
            kind,
            value: value.to_owned(),
            max,
        });
    }
    if !value
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    {
        return Err(NameError::BadCharacter {
            kind,
            value: value.to_owned(),
            allowed: "lower-case letters, digits and '-'",
        });
    }
    if value.starts_with('-') || value.ends_with('-') {
        return Err(NameError::BadEdge {
            kind,
            value: value.to_owned(),
        });
    }
    Ok(())
}

macro_rules! string_newtype {
    ($(#[$meta:meta])* $name:ident, $parse:expr) => {
        $(#[$meta])*
        #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(Arc<str>);

        impl $name {
            pub fn parse(value: &str) -> Result<Self, NameError> {
                let check: fn(&str) -> Result<(), NameError> = $parse;
                check(value)?;
                Ok(Self(value.into()))
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl FromStr for $name {
            type Err = NameError;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Self::parse(s)
            }
        }

        impl TryFrom<String> for $name {
            type Error = NameError;
            fn try_from(value: String) -> Result<Self, Self::Error> {
                Self::parse(&value)
            }
        }

        impl From<$name> for String {
            fn from(value: $name) -> Self {
                value.0.as_ref().to_owned()
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }
    };
}

string_newtype!(
    /// A session's name: a lower-case DNS label of 1 to 40 characters, unique among one user's
    /// live sessions. It is also the SSH user name that reaches the session (`ssh train1@gw`).
    SessionName,
    |v| check_dns_label("session name", v, SessionName::MAX_LEN)
);

impl SessionName {
    pub const MAX_LEN: usize = 40;
}

string_newtype!(
    /// A node's name as its agent registers it: a lower-case DNS label of 1 to 63 characters.
    NodeName,
    |v| check_dns_label("node name", v, 63)
);

string_newtype!(
    /// A Unix login name for the user inside dev containers: 1 to 32 characters of `[a-z0-9_-]`,
    /// starting with a letter or `_` (the portable subset `useradd` accepts).
    UserName,
    check_user_name
);

fn check_user_name(value: &str) -> Result<(), NameError> {
    const KIND: &str = "user name";
    if value.is_empty() {
        return Err(NameError::Empty { kind: KIND });
    }
    if value.len() > 32 {
        return Err(NameError::TooLong {
            kind: KIND,
            value: value.to_owned(),
            max: 32,
        });
    }
    let ok = value
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-');
    if !ok {
        return Err(NameError::BadCharacter {
            kind: KIND,
            value: value.to_owned(),
            allowed: "lower-case letters, digits, '_' and '-'",
        });
    }
    let first = value.as_bytes()[0];
    if !(first.is_ascii_lowercase() || first == b'_') {
        return Err(NameError::BadEdge {
            kind: KIND,
            value: value.to_owned(),
        });
    }
    Ok(())
}

impl UserName {
    /// Derives a login name from a DN: the last CN, lower-cased, with every run of other
    /// characters turned into one `-`, cut to 24 characters; `user` when nothing is left.
    /// The manager makes it unique (it may append a number) and stores it, so it is stable.
    pub fn derive_from_dn(dn: &Dn) -> UserName {
        let cn = dn.common_name().unwrap_or("user");
        let mut out = String::new();
        for c in cn.chars().flat_map(char::to_lowercase) {
            if c.is_ascii_lowercase() || c.is_ascii_digit() {
                out.push(c);
            } else if !out.ends_with('-') && !out.is_empty() {
                out.push('-');
            }
        }
        let mut out: String = out.trim_end_matches('-').chars().take(24).collect();
        out = out.trim_end_matches('-').to_owned();
        if out.is_empty() || !out.as_bytes()[0].is_ascii_lowercase() {
            out = format!("u{out}");
        }
        UserName::parse(&out).unwrap_or_else(|_| UserName("user".into()))
    }
}

/// A distinguished name in the grid's slash form, as `openssl x509 -subject -nameopt compat`
/// and `voms-proxy-info` print it: `/DC=org/DC=example/CN=Alice Smith`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Dn(Arc<str>);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DnError {
    #[error("distinguished name {0:?} must be in slash form, like /DC=org/DC=example/CN=Alice")]
    NotSlashForm(String),
    #[error("distinguished name {0:?} has a component without '=': each must be KEY=value")]
    BadComponent(String),
}

impl Dn {
    pub fn parse(value: &str) -> Result<Self, DnError> {
        let Some(rest) = value.strip_prefix('/') else {
            return Err(DnError::NotSlashForm(value.to_owned()));
        };
        if rest.is_empty() {
            return Err(DnError::NotSlashForm(value.to_owned()));
        }
        // A value may itself contain '/', as in `CN=host/foo.example.org`; such a piece has no
        // '=' and belongs to the previous component, so only the first piece must have one.
        if !rest
            .split('/')
            .next()
            .is_some_and(|first| first.contains('='))
        {
            return Err(DnError::BadComponent(value.to_owned()));
        }
        Ok(Self(value.into()))
    }

    /// Builds a DN from ordered (attribute, value) pairs, most significant first.
    pub fn from_components<'a>(parts: impl IntoIterator<Item = (&'a str, &'a str)>) -> Self {
        let mut s = String::new();
        for (key, value) in parts {
            s.push('/');
            s.push_str(key);
            s.push('=');
            s.push_str(value);
        }
        Self(s.into())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The value of the last `CN=` component, if any.
    pub fn common_name(&self) -> Option<&str> {
        self.0
            .rsplit("/CN=")
            .next()
            .filter(|_| self.0.contains("/CN="))
    }
}

impl fmt::Display for Dn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for Dn {
    type Err = DnError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl TryFrom<String> for Dn {
    type Error = DnError;
    fn try_from(value: String) -> Result<Self, Self::Error> {
        Self::parse(&value)
    }
}

impl From<Dn> for String {
    fn from(value: Dn) -> Self {
        value.0.as_ref().to_owned()
    }
}

/// A session's permanent identifier; also names its container (`ongrid-<id>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SessionId(pub uuid::Uuid);

impl SessionId {
    pub fn new_random() -> Self {
        Self(uuid::Uuid::new_v4())
    }

    /// The Docker container name of this session's dev container.
    pub fn container_name(&self) -> String {
        format!("ongrid-{}", self.0.simple())
    }
}

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl FromStr for SessionId {
    type Err = uuid::Error;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        uuid::Uuid::parse_str(s).map(Self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn session_names() {
        assert!(SessionName::parse("train1").is_ok());
        assert!(SessionName::parse("a").is_ok());
        assert!(SessionName::parse(&"a".repeat(40)).is_ok());
        assert!(matches!(
            SessionName::parse(&"a".repeat(41)),
            Err(NameError::TooLong { max: 40, .. })
        ));
        assert!(matches!(
            SessionName::parse(""),
            Err(NameError::Empty { .. })
        ));
        assert!(matches!(
            SessionName::parse("Train1"),
            Err(NameError::BadCharacter { .. })
        ));
        assert!(matches!(
            SessionName::parse("a_b"),
            Err(NameError::BadCharacter { .. })
        ));
        assert!(matches!(
            SessionName::parse("-ab"),
            Err(NameError::BadEdge { .. })
        ));
        assert!(matches!(
            SessionName::parse("ab-"),
            Err(NameError::BadEdge { .. })
        ));
        let err = SessionName::parse("My Session").unwrap_err().to_string();
        assert!(err.contains("lower-case letters, digits and '-'"), "{err}");
    }

    #[test]
    fn session_name_serde_validates() {
        let ok: SessionName = serde_json::from_str("\"train1\"").unwrap();
        assert_eq!(ok.as_str(), "train1");
        assert!(serde_json::from_str::<SessionName>("\"Bad Name\"").is_err());
    }

    #[test]
    fn dns() {
        let dn = Dn::parse("/DC=org/DC=example/CN=Alice Smith").unwrap();
        assert_eq!(dn.common_name(), Some("Alice Smith"));
        assert!(Dn::parse("CN=Alice,DC=org").is_err());
        assert!(Dn::parse("/").is_err());
        assert!(Dn::parse("/foo").is_err());
        let host = Dn::parse("/DC=org/CN=host/node1.example.org").unwrap();
        assert_eq!(host.common_name(), Some("host/node1.example.org"));
        assert_eq!(Dn::parse("/O=x").unwrap().common_name(), None);
        let built = Dn::from_components([("DC", "org"), ("CN", "Bob")]);
        assert_eq!(built.as_str(), "/DC=org/CN=Bob");
    }

    #[test]
    fn user_names_from_dns() {
        let derive = |s: &str| UserName::derive_from_dn(&Dn::parse(s).unwrap()).to_string();
        assert_eq!(derive("/DC=org/CN=Alice Smith"), "alice-smith");
        assert_eq!(derive("/DC=org/CN=Zoë O'Neil 1234"), "zo-o-neil-1234");
        assert_eq!(derive("/DC=org/CN=123"), "u123");
        assert_eq!(derive("/DC=org/O=none"), "user");
        assert_eq!(derive("/CN=!!!"), "u");
    }

    proptest! {
        #[test]
        fn session_name_parse_never_panics_and_roundtrips(s in "\\PC{0,50}") {
            if let Ok(name) = SessionName::parse(&s) {
                prop_assert_eq!(name.as_str(), s.as_str());
                prop_assert!(name.as_str().len() <= 40);
            }
        }

        #[test]
        fn derived_user_names_are_valid(cn in "\\PC{0,60}") {
            let dn = Dn::from_components([("DC", "org"), ("CN", cn.as_str())]);
            let user = UserName::derive_from_dn(&dn);
            prop_assert!(UserName::parse(user.as_str()).is_ok());
        }
    }
}
