//! Criterion benchmark of a full `plan` over a site.
//!
//! `site_1000x8/pending_10000` is the target scenario: 1,000 nodes of 8 GPUs in mixed builds (T4,
//! A100 40GB, A100 80GB, H100, shared T4s, mixed nodes), about a third of the GPUs busy, a few
//! unhealthy GPUs and offline nodes, and 10,000 pending sessions (mostly one GPU, some 2, 4 and
//! 8, mixed requirements, a few with a preferred node), more than the site can hold. A full plan
//! must take under 50 ms. `idle_site_1000x8/pending_10000` is the same site with nothing in use,
//! and `site_16x8/pending_100` a small site. Sites are generated from a fixed seed, so every run
//! plans the same input.

use chrono::{DateTime, TimeZone, Utc};
use criterion::{black_box, criterion_group, criterion_main, Criterion};
use ongrid_core::{GpuMode, GpuRequest, GpuUuid, MemorySize, NodeName, SessionId, Sharing};
use ongrid_scheduler::{plan, GpuSlot, NodeState, PendingSession, SiteState};

/// SplitMix64: a small, fixed, good-enough generator, so the bench needs no `rand`.
struct Random(u64);

impl Random {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// True with probability `percent`/100.
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    /// Picks from `(weight, value)` pairs.
    fn weighted<T: Copy>(&mut self, choices: &[(u64, T)]) -> T {
        let total: u64 = choices.iter().map(|(weight, _)| weight).sum();
        let mut pick = self.below(total);
        for &(weight, value) in choices {
            if pick < weight {
                return value;
            }
            pick -= weight;
        }
        choices[choices.len() - 1].1
    }
}

#[derive(Clone, Copy)]
struct Model {
    capability: (u16, u16),
    memory_mib: u64,
}

const T4: Model = Model {
    capability: (7, 5),
    memory_mib: 15_360,
};
const A100_40: Model = Model {
    capability: (8, 0),
    memory_mib: 40_960,
};
const A100_80: Model = Model {
    capability: (8, 0),
    memory_mib: 81_920,
};
const H100: Model = Model {
    capability: (9, 0),
    memory_mib: 81_559,
};

const EXCLUSIVE: GpuMode = GpuMode::Exclusive;
const SHARED_2: GpuMode = GpuMode::Shared { max_sessions: 2 };
const SHARED_4: GpuMode = GpuMode::Shared { max_sessions: 4 };

/// A node build: 8 GPUs as (model, mode).
type Build = [(Model, GpuMode); 8];

const BUILDS: [(u64, Build); 6] = [
    (30, [(T4, EXCLUSIVE); 8]),
    (25, [(A100_40, EXCLUSIVE); 8]),
    (20, [(A100_80, EXCLUSIVE); 8]),
    (15, [(H100, EXCLUSIVE); 8]),
    (5, [(T4, SHARED_4); 8]),
    (
        5,
        [
            (A100_40, SHARED_2),
            (A100_40, SHARED_2),
            (A100_40, SHARED_2),
            (A100_40, SHARED_2),
            (T4, EXCLUSIVE),
            (T4, EXCLUSIVE),
            (T4, EXCLUSIVE),
            (T4, EXCLUSIVE),
        ],
    ),
];

struct Scenario {
    nodes: usize,
    pending: usize,
    busy: bool,
    /// Every GPU of a random build, so that nearly every node differs from every other.
    scrambled: bool,
}

fn at(second: i64) -> DateTime<Utc> {
    Utc.timestamp_opt(1_750_000_000 + second, 0)
        .single()
        .expect("valid time")
}

fn node_name(n: usize) -> NodeName {
    NodeName::parse(&format!("gpu-node-{n:04}")).expect("valid node name")
}

fn site(scenario: &Scenario) -> SiteState {
    let mut random = Random(0x6f6e_6772_6964);
    let nodes: Vec<NodeState> = (0..scenario.nodes)
        .map(|n| {
            let build = random.weighted(&BUILDS);
            let gpus = (0..build.len())
                .map(|g| {
                    let (model, mode) = if scenario.scrambled {
                        random.weighted(&BUILDS)[g]
                    } else {
                        build[g]
                    };
                    let used = match (scenario.busy && random.chance(35), mode) {
                        (false, _) => 0,
                        (true, GpuMode::Exclusive) => 1,
                        (true, mode) => 1 + random.below(u64::from(mode.capacity())) as u32,
                    };
                    GpuSlot {
                        uuid: GpuUuid::parse(&format!(
                            "GPU-{n:08x}-{g:04x}-0000-0000-{:012x}",
                            random.below(1 << 48)
                        ))
                        .expect("valid UUID"),
                        capability: ongrid_core::ComputeCapability::new(
                            model.capability.0,
                            model.capability.1,
                        ),
                        memory: MemorySize::from_mib(model.memory_mib),
                        mode,
                        healthy: !random.chance(1),
                        used,
                    }
                })
                .collect();
            NodeState {
                name: node_name(n),
                online: !random.chance(2),
                gpus,
            }
        })
        .collect();
    let pending = (0..scenario.pending)
        .map(|n| {
            let request = GpuRequest {
                count: random.weighted(&[(85, 1), (8, 2), (5, 4), (2, 8)]),
                min_capability: random
                    .weighted(&[
                        (50, None),
                        (10, Some((7, 5))),
                        (30, Some((8, 0))),
                        (10, Some((9, 0))),
                    ])
                    .map(|(major, minor)| ongrid_core::ComputeCapability::new(major, minor)),
                min_memory: random
                    .weighted(&[(60, None), (25, Some("40G")), (15, Some("80G"))])
                    .map(|memory| memory.parse().expect("valid memory")),
                sharing: random.weighted(&[
                    (80, Sharing::Exclusive),
                    (12, Sharing::Any),
                    (8, Sharing::Shared),
                ]),
            };
            let preferred_node = random
                .chance(5)
                .then(|| node_name(random.below(scenario.nodes as u64) as usize));
            // Released sessions go back to their node.
            let pinned_node = random
                .chance(2)
                .then(|| node_name(random.below(scenario.nodes as u64) as usize));
            PendingSession {
                id: format!("{:016x}{n:016x}", random.next())
                    .parse::<SessionId>()
                    .expect("valid session id"),
                request,
                queued_at: at(random.below(86_400) as i64),
                preferred_node,
                pinned_node,
                previous_gpus: Vec::new(),
            }
        })
        .collect();
    SiteState { nodes, pending }
}

fn bench(c: &mut Criterion) {
    let scenarios = [
        (
            "site_16x8/pending_100",
            Scenario {
                nodes: 16,
                pending: 100,
                busy: true,
                scrambled: false,
            },
        ),
        (
            "site_1000x8/pending_10000",
            Scenario {
                nodes: 1000,
                pending: 10_000,
                busy: true,
                scrambled: false,
            },
        ),
        (
            "idle_site_1000x8/pending_10000",
            Scenario {
                nodes: 1000,
                pending: 10_000,
                busy: false,
                scrambled: false,
            },
        ),
        (
            "scrambled_site_1000x8/pending_10000",
            Scenario {
                nodes: 1000,
                pending: 10_000,
                busy: true,
                scrambled: true,
            },
        ),
    ];
    let mut group = c.benchmark_group("plan");
    for (name, scenario) in &scenarios {
        let site = site(scenario);
        let placed = plan(&site, at(86_400)).len();
        eprintln!("{name}: {placed} of {} sessions placed", site.pending.len());
        group.bench_function(*name, |b| b.iter(|| plan(black_box(&site), at(86_400))));
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
