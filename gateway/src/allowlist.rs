//! The institutes' allowlist as the gateway applies it: fetched from the manager every
//! `allowlist_refresh`, checked for every TCP connection before any SSH byte and again at
//! authentication. The last good list is kept while the manager is unreachable; before the
//! first successful fetch everyone is refused (with a log line saying why).

use std::net::IpAddr;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use ongrid_core::api::Allowlist;
use ongrid_core::{normalize_ip, InstituteName};
use tokio_util::sync::CancellationToken;

use crate::manager::GatewayRoutes;

/// What the allowlist says about one address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The address belongs to this institute.
    Allowed(InstituteName),
    /// No institute's networks contain the address.
    Refused,
    /// No allowlist has been fetched yet: nobody is allowed.
    NotLoaded,
}

/// The current allowlist, shared by the accept loop, the connections and the refresher.
#[derive(Debug, Default)]
pub struct SharedAllowlist {
    current: RwLock<Option<Arc<Allowlist>>>,
}

impl SharedAllowlist {
    pub fn new() -> Self {
        Self::default()
    }

    /// The verdict for `address` (IPv4-mapped IPv6 addresses are matched as IPv4).
    pub fn check(&self, address: IpAddr) -> Verdict {
        let Some(list) = self.snapshot() else {
            return Verdict::NotLoaded;
        };
        match list.institute_of(normalize_ip(address)) {
            Some(institute) => Verdict::Allowed(institute.clone()),
            None => Verdict::Refused,
        }
    }

    /// Whether a list was fetched from the manager (until then every connection is refused).
    pub fn is_loaded(&self) -> bool {
        self.snapshot().is_some()
    }

    /// Installs a new list; returns whether it differs from the previous one.
    pub fn replace(&self, list: Allowlist) -> bool {
        let mut current = self
            .current
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let changed = current.as_deref() != Some(&list);
        if changed {
            *current = Some(Arc::new(list));
        }
        changed
    }

    fn snapshot(&self) -> Option<Arc<Allowlist>> {
        self.current
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

/// Fetches the allowlist now and then every `every` until `shutdown`, keeping the last good
/// one when a fetch fails. Failures are logged when they start and when they end.
pub async fn refresh(
    manager: GatewayRoutes,
    shared: Arc<SharedAllowlist>,
    every: Duration,
    shutdown: CancellationToken,
) {
    let mut ticker = tokio::time::interval(every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let fetched = tokio::select! {
            () = shutdown.cancelled() => return,
            fetched = manager.allowlist() => fetched,
        };
        match fetched {
            Ok(list) => {
                if failing {
                    tracing::info!("The manager answers again: allowlist refreshed.");
                    failing = false;
                }
                let institutes = list.institutes.len();
                let networks: usize = list.institutes.iter().map(|i| i.cidrs.len()).sum();
                if shared.replace(list) {
                    tracing::info!(institutes, networks, "Allowlist updated.");
                }
            }
            Err(error) => {
                let loaded = shared.snapshot().is_some();
                if !failing {
                    let error = anyhow::Error::from(error);
                    if loaded {
                        tracing::warn!(
                            error = format!("{error:#}"),
                            "Cannot refresh the allowlist; keeping the last one."
                        );
                    } else {
                        tracing::error!(
                            error = format!("{error:#}"),
                            "Cannot fetch the allowlist; refusing every connection until it is fetched."
                        );
                    }
                    failing = true;
                } else {
                    tracing::debug!(error = %error, "Allowlist refresh failed again.");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ongrid_core::{Cidr, Institute};

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn list(entries: &[(&str, &[&str])]) -> Allowlist {
        Allowlist {
            institutes: entries
                .iter()
                .map(|(name, cidrs)| Institute {
                    name: InstituteName::parse(name).unwrap(),
                    cidrs: cidrs.iter().map(|c| Cidr::parse(c).unwrap()).collect(),
                })
                .collect(),
        }
    }

    #[test]
    fn nobody_before_the_first_fetch_then_the_list_decides() {
        let shared = SharedAllowlist::new();
        assert_eq!(shared.check(ip("127.0.0.1")), Verdict::NotLoaded);

        assert!(shared.replace(list(&[("uni-a", &["10.1.0.0/16", "2001:db8::/32"])])));
        let uni_a = Verdict::Allowed(InstituteName::parse("uni-a").unwrap());
        assert_eq!(shared.check(ip("10.1.2.3")), uni_a);
        assert_eq!(
            shared.check(ip("::ffff:10.1.2.3")),
            uni_a,
            "IPv4-mapped IPv6 peers match IPv4 networks"
        );
        assert_eq!(shared.check(ip("2001:db8::5")), uni_a);
        assert_eq!(shared.check(ip("10.2.0.1")), Verdict::Refused);
        assert_eq!(shared.check(ip("::ffff:127.0.0.1")), Verdict::Refused);

        assert!(!shared.replace(list(&[("uni-a", &["10.1.0.0/16", "2001:db8::/32"])])));
        assert!(shared.replace(list(&[])));
        assert_eq!(shared.check(ip("10.1.2.3")), Verdict::Refused);
    }
}
