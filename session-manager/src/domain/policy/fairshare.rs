//! Fair share weighted by GPU cost: who goes first among waiting requests of the same class.
//!
//! Every user has an account: their accounting group (from [`super::admission`]) and their
//! usage, in cost-weighted GPU-hours decayed with the configured half-life (a GPU-hour used one
//! half-life ago counts half). A GPU held for an hour charges the cost weight of its model (the
//! longest `[fairshare] cost` name found in the model name, e.g. `A100 = 1.0`, `H100 = 2.0`;
//! others 1.0), divided by its places when a session shares it (`shared:N`: 1/N each); a MIG
//! device charges its compute slices' fraction of its GPU's weight (`3g.40gb` of an A100: 3/7).
//!
//! A group's standing is its share of all usage against its share of the site
//! (`[fairshare] shares`, groups not listed: 1): `usage_fraction / share_fraction`, lower first,
//! shown as Slurm's fair-share factor `2^(-usage_fraction / share_fraction)` (1 = unused,
//! 0.5 = used exactly its share). Within a group, lower own usage goes first. Everything here is
//! pure: time comes in as `now`, usage as accounts.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use ongrid_core::mig::{MigModel, MigProfile};
use ongrid_core::Dn;
use ongrid_scheduler::Priority;

use super::GroupName;

/// The default half-life of usage: one day.
pub const DEFAULT_HALF_LIFE: Duration = Duration::from_secs(86_400);

/// What a MIG device of `profile` charges of the weight of its GPU, a `model`: its compute
/// slices of the model's (`3g.40gb` of an A100: 3/7; `2g.12gb` of an A30: 2/4). A model whose
/// geometry is not known here counts 7 slices, the most any GPU has.
pub fn mig_fraction(model: &str, profile: MigProfile) -> f64 {
    let slices = MigModel::of(model).map_or(7, |m| m.compute_slices);
    f64::from(profile.slices.min(slices)) / f64::from(slices)
}

/// The validated `[fairshare]` section.
#[derive(Debug, Clone, PartialEq)]
pub struct FairShareConfig {
    pub half_life: Duration,
    /// Relative shares per group; a group not listed has 1.
    pub shares: BTreeMap<GroupName, u32>,
    /// (name in the model, weight); the longest name found in a model wins; none: 1.0.
    pub cost: Vec<(String, f64)>,
}

impl Default for FairShareConfig {
    fn default() -> Self {
        Self {
            half_life: DEFAULT_HALF_LIFE,
            shares: BTreeMap::new(),
            cost: Vec::new(),
        }
    }
}

impl FairShareConfig {
    /// The cost weight of one hour of a whole GPU of `model` (`NVIDIA A100-SXM4-40GB`).
    pub fn weight(&self, model: &str) -> f64 {
        let model = model.to_ascii_lowercase();
        self.cost
            .iter()
            .filter(|(name, _)| model.contains(&name.to_ascii_lowercase()))
            .max_by_key(|(name, _)| name.len())
            .map_or(1.0, |(_, weight)| *weight)
    }

    pub fn share(&self, group: &GroupName) -> u32 {
        self.shares.get(group).copied().unwrap_or(1)
    }
}

/// One user's account as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct Account {
    pub user: Dn,
    pub group: GroupName,
    /// Cost-weighted GPU-hours, decayed to `updated_at`.
    pub usage: f64,
    pub updated_at: DateTime<Utc>,
}

fn decay_factor(seconds: f64, half_life: Duration) -> f64 {
    (-seconds / half_life.as_secs_f64().max(1.0)).exp2()
}

/// The account's usage at `now`: decayed since `updated_at`, plus what holding
/// `weighted_gpus` (cost-weighted GPUs, constant over the interval) charged meanwhile, itself
/// decayed as it accrued. Time never runs backwards: an earlier `now` changes nothing.
pub fn advance(
    account: &Account,
    weighted_gpus: f64,
    now: DateTime<Utc>,
    half_life: Duration,
) -> f64 {
    let seconds = (now - account.updated_at).num_milliseconds().max(0) as f64 / 1000.0;
    if seconds == 0.0 {
        return account.usage;
    }
    let decay = decay_factor(seconds, half_life);
    // ∫ r·2^(-(t-s)/h) ds over the interval, in hours: r·h/ln 2·(1 - 2^(-t/h)).
    let half_life_hours = half_life.as_secs_f64().max(1.0) / 3600.0;
    let charged = weighted_gpus * half_life_hours / std::f64::consts::LN_2 * (1.0 - decay);
    account.usage * decay + charged
}

/// One group as `devctl share` shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupStanding {
    pub group: GroupName,
    pub share: u32,
    /// Its share of all groups' shares (groups with accounts or listed in the config).
    pub share_fraction: f64,
    /// Decayed cost-weighted GPU-hours of its users.
    pub usage: f64,
    /// Its part of all groups' usage (0 when nobody used anything).
    pub usage_fraction: f64,
    /// `2^(-usage_fraction / share_fraction)`: 1 unused, 0.5 at its share, less above it.
    pub factor: f64,
    /// Its users' decayed usage, most first.
    pub users: Vec<(Dn, f64)>,
}

/// Every group's standing from the accounts (already advanced to the same time), most
/// favoured (highest factor) first, then by name.
pub fn standings(accounts: &[Account], config: &FairShareConfig) -> Vec<GroupStanding> {
    let mut groups: BTreeMap<GroupName, Vec<(Dn, f64)>> = BTreeMap::new();
    for group in config.shares.keys() {
        groups.entry(group.clone()).or_default();
    }
    for account in accounts {
        groups
            .entry(account.group.clone())
            .or_default()
            .push((account.user.clone(), account.usage.max(0.0)));
    }
    let total_share: f64 = groups.keys().map(|g| f64::from(config.share(g))).sum();
    // Folded from +0.0: an empty `sum` of floats is -0.0, shown as "-0.00".
    let total_usage = groups.values().flatten().fold(0.0, |sum, (_, u)| sum + u);
    let mut standings: Vec<GroupStanding> = groups
        .into_iter()
        .map(|(group, mut users)| {
            let share = config.share(&group);
            let share_fraction = if total_share > 0.0 {
                f64::from(share) / total_share
            } else {
                0.0
            };
            let usage = users.iter().fold(0.0, |sum, (_, u)| sum + u);
            let usage_fraction = if total_usage > 0.0 {
                usage / total_usage
            } else {
                0.0
            };
            users.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
            GroupStanding {
                factor: factor(usage_fraction, share_fraction),
                group,
                share,
                share_fraction,
                usage,
                usage_fraction,
                users,
            }
        })
        .collect();
    standings.sort_by(|a, b| {
        b.factor
            .total_cmp(&a.factor)
            .then_with(|| a.group.cmp(&b.group))
    });
    standings
}

fn factor(usage_fraction: f64, share_fraction: f64) -> f64 {
    if usage_fraction <= 0.0 {
        1.0
    } else if share_fraction <= 0.0 {
        0.0
    } else {
        (-usage_fraction / share_fraction).exp2()
    }
}

/// The scheduler's priority of a request by `user` of `group`: the group's usage against its
/// share first, then the user's own usage; lower is served first. Unknown users and groups
/// (no account yet) have used nothing.
pub fn priority(standings: &[GroupStanding], group: &GroupName, user: &Dn) -> Priority {
    let Some(standing) = standings.iter().find(|s| &s.group == group) else {
        return Priority::default();
    };
    let ratio = if standing.share_fraction > 0.0 {
        standing.usage_fraction / standing.share_fraction
    } else {
        f64::from(u32::MAX)
    };
    let own = standing
        .users
        .iter()
        .find(|(dn, _)| dn == user)
        .map_or(0.0, |(_, usage)| *usage);
    Priority {
        group: scaled(ratio, 1e6),
        user: scaled(own, 1e3),
    }
}

fn scaled(value: f64, scale: f64) -> u64 {
    let value = (value * scale).round();
    if value.is_nan() || value <= 0.0 {
        0
    } else if value >= u64::MAX as f64 {
        u64::MAX
    } else {
        value as u64
    }
}

#[cfg(test)]
mod tests {
    use chrono::TimeDelta;
    use proptest::prelude::*;

    use super::*;

    fn t0() -> DateTime<Utc> {
        DateTime::from_timestamp(1_700_000_000, 0).unwrap()
    }

    fn group(name: &str) -> GroupName {
        GroupName::parse(name).unwrap()
    }

    fn dn(n: usize) -> Dn {
        Dn::parse(&format!("/DC=org/CN=User {n}")).unwrap()
    }

    fn account(n: usize, group_name: &str, usage: f64) -> Account {
        Account {
            user: dn(n),
            group: group(group_name),
            usage,
            updated_at: t0(),
        }
    }

    #[test]
    fn usage_halves_every_half_life_and_holding_gpus_charges_cost_weighted_hours() {
        let day = DEFAULT_HALF_LIFE;
        let a = account(1, "atlas", 10.0);
        let later = t0() + TimeDelta::days(1);
        assert!((advance(&a, 0.0, later, day) - 5.0).abs() < 1e-9);
        // Two H100s (weight 2) for one minute: about 4 × 1/60 GPU-hours, barely decayed.
        let fresh = account(2, "atlas", 0.0);
        let charged = advance(&fresh, 4.0, t0() + TimeDelta::minutes(1), day);
        assert!((charged - 4.0 / 60.0).abs() < 1e-4, "{charged}");
        // Held for ever, usage tends to rate × half-life / ln 2 (hours).
        let steady = advance(&fresh, 1.0, t0() + TimeDelta::days(100), day);
        assert!(
            (steady - 24.0 / std::f64::consts::LN_2).abs() < 1e-6,
            "{steady}"
        );
        // Time running backwards changes nothing.
        assert_eq!(advance(&a, 5.0, t0() - TimeDelta::hours(1), day), 10.0);
    }

    #[test]
    fn cost_weights_match_the_longest_name_in_the_model() {
        let config = FairShareConfig {
            cost: vec![
                ("H100".into(), 2.0),
                ("A100".into(), 1.0),
                ("A100-SXM4-80GB".into(), 1.5),
                ("T4".into(), 0.25),
            ],
            ..FairShareConfig::default()
        };
        assert_eq!(config.weight("NVIDIA H100 80GB HBM3"), 2.0);
        assert_eq!(config.weight("NVIDIA A100-SXM4-40GB"), 1.0);
        assert_eq!(config.weight("NVIDIA A100-SXM4-80GB"), 1.5);
        assert_eq!(config.weight("Tesla T4"), 0.25);
        assert_eq!(config.weight("NVIDIA L4"), 1.0);
    }

    #[test]
    fn a_group_below_its_share_goes_before_one_above_it() {
        let config = FairShareConfig {
            shares: [(group("atlas"), 3), (group("cms"), 1)]
                .into_iter()
                .collect(),
            ..FairShareConfig::default()
        };
        // atlas used 60 of 100 (share 75%), cms 40 (share 25%).
        let accounts = [account(1, "atlas", 60.0), account(2, "cms", 40.0)];
        let standings = standings(&accounts, &config);
        assert_eq!(standings[0].group.as_str(), "atlas");
        assert!((standings[0].factor - (-0.6f64 / 0.75).exp2()).abs() < 1e-9);
        assert!((standings[1].factor - (-0.4f64 / 0.25).exp2()).abs() < 1e-9);
        assert!(
            priority(&standings, &group("atlas"), &dn(1))
                < priority(&standings, &group("cms"), &dn(2))
        );
        // Nobody used anything: every factor is 1, and no usage is negative zero.
        let idle = standings_of_nothing(&config);
        assert!(idle.iter().all(|s| s.factor == 1.0));
        assert!(idle.iter().all(|s| s.usage.is_sign_positive()));
    }

    fn standings_of_nothing(config: &FairShareConfig) -> Vec<GroupStanding> {
        standings(&[], config)
    }

    proptest! {
        /// The order of requests follows decayed, cost-weighted usage: after any history of
        /// holdings, a group whose usage is lower relative to its share never comes after one
        /// whose usage is higher, and within a group a user who used less never comes after one
        /// who used more.
        #[test]
        fn order_follows_decayed_cost_weighted_usage(
            history in proptest::collection::vec((0usize..6, 0u32..4, 1i64..7200), 1..40),
            shares in proptest::collection::vec(1u32..5, 3),
        ) {
            let groups = ["atlas", "cms", "lhcb"];
            let config = FairShareConfig {
                shares: groups.iter().zip(&shares).map(|(g, s)| (group(g), *s)).collect(),
                cost: vec![("H100".into(), 2.0)],
                half_life: Duration::from_secs(3 * 3600),
            };
            let mut accounts: Vec<Account> =
                (0..6).map(|n| account(n, groups[n % 3], 0.0)).collect();
            let mut now = t0();
            for (user, gpus, seconds) in history {
                now += TimeDelta::seconds(seconds);
                let weight = f64::from(gpus) * config.weight("NVIDIA H100");
                for account in &mut accounts {
                    let held = if account.user == dn(user) { weight } else { 0.0 };
                    account.usage = advance(account, held, now, config.half_life);
                    account.updated_at = now;
                }
            }
            let standings = standings(&accounts, &config);
            let ratio = |g: &GroupStanding| g.usage_fraction / g.share_fraction;
            for a in &accounts {
                for b in &accounts {
                    let (pa, pb) = (
                        priority(&standings, &a.group, &a.user),
                        priority(&standings, &b.group, &b.user),
                    );
                    let ga = standings.iter().find(|s| s.group == a.group).unwrap();
                    let gb = standings.iter().find(|s| s.group == b.group).unwrap();
                    if ratio(ga) + 1e-5 < ratio(gb) {
                        prop_assert!(pa < pb, "{pa:?} {pb:?}");
                    }
                    if a.group == b.group && a.usage + 1e-2 < b.usage {
                        prop_assert!(pa < pb, "{pa:?} {pb:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn a_mig_device_charges_its_slices_of_its_gpu() {
        let profile = |text: &str| MigProfile::parse(text).unwrap();
        let a100 = "NVIDIA A100-SXM4-40GB";
        assert_eq!(mig_fraction(a100, profile("3g.20gb")), 3.0 / 7.0);
        assert_eq!(mig_fraction(a100, profile("1g.5gb")), 1.0 / 7.0);
        assert_eq!(mig_fraction(a100, profile("7g.40gb")), 1.0);
        assert_eq!(mig_fraction("NVIDIA A30", profile("2g.12gb")), 0.5);
        assert_eq!(mig_fraction("NVIDIA A30", profile("1g.6gb")), 0.25);
        assert_eq!(
            mig_fraction("Some Future GPU", profile("2g.20gb")),
            2.0 / 7.0
        );
    }
}
