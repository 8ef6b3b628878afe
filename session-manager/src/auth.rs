//! The credentials callers are checked against, beside a connection's TLS client identity
//! ([`crate::grid_identity::Peer`]): the config's [`Admins`], the agents' per-node tokens
//! ([`AgentTokens`]) and the SSH gateway's token ([`GatewayToken`]). The API's extractors
//! (`crate::api::callers`) use these to name the caller of each request. Tokens are kept as
//! SHA-256 digests and compared in constant time.
//!
//! Admins are named in the config by DN or by VOMS FQAN ([`Admins`]); a user is an admin when
//! their DN is listed or one of the verified FQANs of the credential they presented is.

use std::collections::BTreeSet;
use std::fmt;
use std::path::{Path, PathBuf};

use ongrid_core::{Dn, NodeName};
use ongrid_x509::voms::Fqan;
use sha2::{Digest, Sha256};

/// The admins of the config's `admins`: DNs, and VOMS FQAN patterns whose holders are admins.
///
/// An FQAN pattern is `/<vo>[/<group>...][/Role=<role>]`, matched as VOMS policies are
/// ([`Fqan::matches`]): `/myvo/Role=admin` matches the verified FQAN
/// `/myvo/Role=admin/Capability=NULL`; `/myvo` any role in the group `/myvo` (not its subgroups).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Admins {
    dns: BTreeSet<Dn>,
    fqans: Vec<Fqan>,
}

impl Admins {
    /// Each entry is a slash-form DN (its first component has `=`) or an FQAN (it has none).
    pub fn parse(entries: &[String]) -> Result<Self, String> {
        let mut admins = Self::default();
        for entry in entries {
            let entry = entry.trim();
            let first = entry
                .strip_prefix('/')
                .and_then(|rest| rest.split('/').next())
                .unwrap_or_default();
            if !first.is_empty() && !first.contains('=') {
                let fqan = Fqan::parse(entry).map_err(|e| e.to_string())?;
                if !admins.fqans.contains(&fqan) {
                    admins.fqans.push(fqan);
                }
            } else {
                let dn = Dn::parse(entry).map_err(|e| {
                    format!(
                        "{e}: list DNs like /DC=org/DC=example/CN=Site Admin or FQANs like \
                         /myvo/Role=admin"
                    )
                })?;
                admins.dns.insert(dn);
            }
        }
        Ok(admins)
    }

    /// Whether `dn` is listed by DN.
    pub fn contains(&self, dn: &Dn) -> bool {
        self.dns.contains(dn)
    }

    /// Whether the holder of `dn` with the verified `fqans` is an admin.
    pub fn admits(&self, dn: &Dn, fqans: &[Fqan]) -> bool {
        self.contains(dn)
            || fqans
                .iter()
                .any(|fqan| self.fqans.iter().any(|pattern| fqan.matches(pattern)))
    }

    pub fn is_empty(&self) -> bool {
        self.dns.is_empty() && self.fqans.is_empty()
    }
}

/// Why the gateway token file was refused.
#[derive(Debug, thiserror::Error)]
pub enum GatewayTokenError {
    #[error("reading gateway_token_file {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("gateway_token_file {}: {message}", path.display())]
    Invalid { path: PathBuf, message: String },
}

/// The gateway's token, kept only as a SHA-256 digest; `Debug` never shows it.
pub struct GatewayToken {
    digest: [u8; 32],
}

impl fmt::Debug for GatewayToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("GatewayToken(<secret>)")
    }
}

impl GatewayToken {
    /// Reads the file: one line, the token (surrounding blank space ignored).
    pub fn load(path: &Path) -> Result<Self, GatewayTokenError> {
        let text = std::fs::read_to_string(path).map_err(|source| GatewayTokenError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&text).map_err(|message| GatewayTokenError::Invalid {
            path: path.to_owned(),
            message,
        })
    }

    /// Checks the file's text; the error says what is wrong with it.
    pub fn parse(text: &str) -> Result<Self, String> {
        let token = text.trim();
        if token.is_empty() {
            return Err(
                "is empty: put the gateway's token in it (`openssl rand -hex 32`)".to_owned(),
            );
        }
        if token.contains(char::is_whitespace) {
            return Err("must hold one token on one line, without spaces".to_owned());
        }
        if token.len() < MIN_TOKEN_LEN {
            return Err(format!(
                "the token is shorter than {MIN_TOKEN_LEN} characters: make one with \
                 `openssl rand -hex 32`"
            ));
        }
        Ok(Self {
            digest: digest(token),
        })
    }

    /// Whether `token` is the gateway's (constant time).
    pub fn matches(&self, token: &str) -> bool {
        constant_time_eq(&digest(token), &self.digest)
    }

    /// The node whose agent token is the same as the gateway's, if any: each must have its own.
    pub fn shared_with<'a>(&self, agents: &'a AgentTokens) -> Option<&'a NodeName> {
        agents.node_of(&self.digest)
    }
}

/// Why the agent tokens file was refused.
#[derive(Debug, thiserror::Error)]
pub enum TokenFileError {
    #[error("reading agent_tokens_file {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("agent_tokens_file {} line {line}: {message}", path.display())]
    Line {
        path: PathBuf,
        line: usize,
        message: String,
    },
}

/// The shortest token accepted: shorter ones can be guessed.
pub const MIN_TOKEN_LEN: usize = 16;

/// The per-node tokens, kept only as SHA-256 digests; `Debug` shows node names only.
pub struct AgentTokens {
    entries: Vec<(NodeName, [u8; 32])>,
}

impl fmt::Debug for AgentTokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AgentTokens")
            .field(
                "nodes",
                &self.entries.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl AgentTokens {
    /// Reads lines `<node-name> <token>`; blank lines and `#` comments are skipped.
    pub fn load(path: &Path) -> Result<Self, TokenFileError> {
        let text = std::fs::read_to_string(path).map_err(|source| TokenFileError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&text).map_err(|(line, message)| TokenFileError::Line {
            path: path.to_owned(),
            line,
            message,
        })
    }

    /// Parses the file's text; an error carries the 1-based line number.
    pub fn parse(text: &str) -> Result<Self, (usize, String)> {
        let mut entries = Vec::new();
        let mut nodes = BTreeSet::new();
        let mut digests = BTreeSet::new();
        for (index, line) in text.lines().enumerate() {
            let number = index + 1;
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let fields: Vec<&str> = line.split_whitespace().collect();
            let [node, token] = fields[..] else {
                return Err((
                    number,
                    "must be `<node-name> <token>` (two fields)".to_owned(),
                ));
            };
            let node = NodeName::parse(node).map_err(|e| (number, e.to_string()))?;
            if token.len() < MIN_TOKEN_LEN {
                return Err((
                    number,
                    format!(
                        "the token of {node} is shorter than {MIN_TOKEN_LEN} characters: \
                         make one with `openssl rand -hex 32`"
                    ),
                ));
            }
            if !nodes.insert(node.clone()) {
                return Err((number, format!("node {node} is listed twice")));
            }
            let digest = digest(token);
            if !digests.insert(digest) {
                return Err((
                    number,
                    format!("the token of {node} is also another node's: give each its own"),
                ));
            }
            entries.push((node, digest));
        }
        Ok(Self { entries })
    }

    /// The node this token belongs to. Compares digests in constant time and always looks at
    /// every entry, so timing tells nothing about how close a guess was.
    pub fn node_for(&self, token: &str) -> Option<&NodeName> {
        self.node_of(&digest(token))
    }

    /// The node whose token has `digest`, found as [`Self::node_for`] finds it.
    fn node_of(&self, digest: &[u8; 32]) -> Option<&NodeName> {
        self.entries.iter().fold(None, |found, (node, expected)| {
            constant_time_eq(digest, expected).then_some(node).or(found)
        })
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

fn constant_time_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    let difference = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(difference) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = "\
# node tokens
node1 0123456789abcdef0123456789abcdef

  node2   fedcba9876543210fedcba9876543210  \n";

    #[test]
    fn tokens_name_their_node() {
        let tokens = AgentTokens::parse(FILE).unwrap();
        assert_eq!(tokens.len(), 2);
        assert_eq!(
            tokens
                .node_for("0123456789abcdef0123456789abcdef")
                .map(NodeName::as_str),
            Some("node1")
        );
        assert_eq!(
            tokens
                .node_for("fedcba9876543210fedcba9876543210")
                .map(NodeName::as_str),
            Some("node2")
        );
        assert_eq!(tokens.node_for("0123456789abcdef0123456789abcdee"), None);
        assert_eq!(tokens.node_for(""), None);
        let debug = format!("{tokens:?}");
        assert!(!debug.contains("0123456789abcdef"), "{debug}");
    }

    #[test]
    fn bad_lines_are_refused_with_their_number() {
        let err = |text: &str| AgentTokens::parse(text).unwrap_err();
        assert_eq!(err("node1\n").0, 1);
        assert_eq!(err("# c\nnode1 a b\n").0, 2);
        assert!(err("Node_1 0123456789abcdef0123\n").1.contains("node name"));
        assert!(err("node1 short\n").1.contains("openssl rand"));
        let twice = "node1 0123456789abcdef0123\nnode1 0123456789abcdef9999\n";
        assert_eq!(err(twice), (2, "node node1 is listed twice".to_owned()));
        let shared = "node1 0123456789abcdef0123\nnode2 0123456789abcdef0123\n";
        assert_eq!(err(shared).0, 2);
    }

    #[test]
    fn the_gateway_token_is_one_line_and_secret() {
        let token = GatewayToken::parse("  gw-0123456789abcdef0123\n").unwrap();
        assert!(token.matches("gw-0123456789abcdef0123"));
        assert!(!token.matches("gw-0123456789abcdef0124"));
        assert!(!token.matches(""));
        assert_eq!(format!("{token:?}"), "GatewayToken(<secret>)");
        assert!(GatewayToken::parse("\n").unwrap_err().contains("empty"));
        assert!(GatewayToken::parse("short")
            .unwrap_err()
            .contains("openssl rand"));
        assert!(
            GatewayToken::parse("0123456789abcdef0123\nsecond-line-0123456789")
                .unwrap_err()
                .contains("one line")
        );
        let agents = AgentTokens::parse(FILE).unwrap();
        let shared = GatewayToken::parse("fedcba9876543210fedcba9876543210").unwrap();
        assert_eq!(
            shared.shared_with(&agents).map(NodeName::as_str),
            Some("node2")
        );
        assert_eq!(token.shared_with(&agents), None);

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("gateway-token");
        std::fs::write(&path, "x\n").unwrap();
        let message = GatewayToken::load(&path).unwrap_err().to_string();
        assert!(message.starts_with("gateway_token_file "), "{message}");
        assert!(matches!(
            GatewayToken::load(&dir.path().join("missing")),
            Err(GatewayTokenError::Read { .. })
        ));
    }

    #[test]
    fn admins_by_dn_or_fqan() {
        let admins = Admins::parse(&[
            "/DC=org/DC=example/CN=Site Admin".to_owned(),
            "/myvo/Role=admin".to_owned(),
            "/othervo/ops".to_owned(),
        ])
        .unwrap();
        let dn = |s: &str| Dn::parse(s).unwrap();
        let alice = dn("/DC=org/DC=example/CN=Alice");
        assert!(admins.contains(&dn("/DC=org/DC=example/CN=Site Admin")));
        assert!(admins.admits(&dn("/DC=org/DC=example/CN=Site Admin"), &[]));
        assert!(!admins.admits(&alice, &[]));
        let fqans = |list: &[&str]| {
            list.iter()
                .map(|s| Fqan::parse(s).unwrap())
                .collect::<Vec<_>>()
        };
        assert!(admins.admits(
            &alice,
            &fqans(&[
                "/myvo/Role=NULL/Capability=NULL",
                "/myvo/Role=admin/Capability=NULL"
            ])
        ));
        assert!(admins.admits(&alice, &fqans(&["/othervo/ops/Role=production"])));
        assert!(!admins.admits(&alice, &fqans(&["/myvo/Role=NULL/Capability=NULL"])));
        assert!(!admins.admits(&alice, &fqans(&["/othervo/Role=NULL"])));
        assert!(!admins.admits(&alice, &fqans(&["/myvo/sub/Role=admin"])));
        assert!(Admins::parse(&[]).unwrap().is_empty());
        for bad in [
            "CN=Bob,O=x",
            "/myvo//Role=admin",
            "/myvo/Role=admin/extra",
            "/",
        ] {
            assert!(Admins::parse(&[bad.to_owned()]).is_err(), "{bad}");
        }
    }

    #[test]
    fn load_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent-tokens");
        std::fs::write(&path, "node1 x\n").unwrap();
        let message = AgentTokens::load(&path).unwrap_err().to_string();
        assert!(message.starts_with("agent_tokens_file "), "{message}");
        assert!(message.contains("line 1"), "{message}");
        let missing = AgentTokens::load(&dir.path().join("missing")).unwrap_err();
        assert!(matches!(missing, TokenFileError::Read { .. }));
    }
}
