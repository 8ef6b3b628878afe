//! The planner's working copy of the site: free capacity, indexed so that one placement costs
//! about the number of GPU classes rather than the number of GPUs.
//!
//! Built once per plan from the [`SiteState`], then only ever shrinks as sessions and jobs are
//! placed. Only online, undrained nodes and their healthy, undrained GPUs are in it (full GPUs too, since halting a
//! job may free them). Three views are kept in step:
//!
//! - every GPU with its class and free places, numbered in (node name, GPU UUID) order, and every
//!   node with the range of its GPUs, numbered in node-name order, so that comparing numbers
//!   compares names and ties break the same way whatever the input order was;
//! - per class, the GPUs that have a free place, fullest first (`(free places, GPU)`), which
//!   answers a one-GPU request with the first entry of the least fitting class;
//! - nodes grouped by their *signature*, how many GPUs of each class have a free place. Nodes
//!   with the same signature are interchangeable except for their name, and real sites have
//!   few signatures (nodes come in a handful of builds), so a multi-GPU request looks at each
//!   signature once instead of at every node.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;

use chrono::{DateTime, Utc};
use ongrid_core::{GpuRequest, GpuUuid, NodeName};

use crate::class::GpuClass;
use crate::policy::{Policy, Tag, Who};
use crate::site::{GpuSlot, NodeState, SiteState};

/// How many GPUs of each class have a free place on a node: `(class, GPUs)` in class order,
/// GPUs > 0.
type Signature = Vec<(usize, u32)>;

#[derive(Debug)]
struct Gpu<'a> {
    uuid: &'a GpuUuid,
    node: usize,
    class: usize,
    free: u32,
}

#[derive(Debug)]
struct Node<'a> {
    name: &'a NodeName,
    gpus: Range<usize>,
    signature: Signature,
}

#[derive(Debug)]
pub(crate) struct Index<'a> {
    /// Least capable first; a class's number is its position here.
    classes: Vec<GpuClass>,
    /// The owners and reservations GPUs are bound by; a class's `tag` is a position here, and
    /// the first is the tag of a GPU bound by nothing.
    tags: Vec<Tag>,
    policy: &'a Policy,
    now: DateTime<Utc>,
    gpus: Vec<Gpu<'a>>,
    nodes: Vec<Node<'a>>,
    /// Per class: `(free places, GPU)` of its GPUs that have a free place.
    free_by_class: Vec<BTreeSet<(u32, usize)>>,
    /// Nodes with at least one free GPU, grouped by signature, in name order.
    nodes_by_signature: BTreeMap<Signature, BTreeSet<usize>>,
}

impl<'a> Index<'a> {
    pub fn new(site: &'a SiteState, now: DateTime<Utc>) -> Self {
        let mut online: Vec<_> = site
            .nodes
            .iter()
            .filter(|node| node.online && !node.drained)
            .collect();
        online.sort_by(|a, b| a.name.cmp(&b.name));

        let usable = |node: &'a NodeState| {
            node.gpus
                .iter()
                .filter(|slot| slot.healthy && !slot.drained)
        };
        // Only the GPUs an owner or a reservation binds (few, or none) have a tag of their own;
        // the others have the default one, number 0, without looking their UUID up.
        let bound = site.policy.bound_gpus(now);
        let is_bound = |slot: &GpuSlot| bound.contains(&slot.uuid);
        let mut tags: Vec<Tag> = online
            .iter()
            .flat_map(|node| usable(node))
            .filter(|slot| is_bound(slot))
            .map(|slot| site.policy.tag(&slot.uuid, now))
            .chain([Tag::default()])
            .collect();
        tags.sort_unstable();
        tags.dedup();
        // The tag of a GPU bound by nothing sorts first.
        debug_assert_eq!(tags.first(), Some(&Tag::default()));
        let tag_of = |slot: &GpuSlot| {
            if !is_bound(slot) {
                debug_assert_eq!(site.policy.tag(&slot.uuid, now), Tag::default());
                return 0;
            }
            let tag = site.policy.tag(&slot.uuid, now);
            tags.binary_search(&tag).unwrap_or(0)
        };
        let class_of = |slot: &GpuSlot| GpuClass {
            capability: slot.capability,
            memory: slot.memory,
            mode: slot.mode,
            tag: tag_of(slot),
        };
        // GPUs of a node are mostly alike: a class equal to the one before is not ordered again.
        let mut classes: Vec<GpuClass> = Vec::new();
        for class in online.iter().flat_map(|node| usable(node).map(class_of)) {
            if classes.last() != Some(&class) {
                classes.push(class);
            }
        }
        classes.sort_unstable();
        classes.dedup_by(|a, b| Ord::cmp(&*a, &*b).is_eq());
        let gpu_count = online.iter().map(|node| usable(node).count()).sum();

        let mut index = Self {
            free_by_class: Vec::new(),
            classes,
            tags: Vec::new(),
            policy: &site.policy,
            now,
            gpus: Vec::with_capacity(gpu_count),
            nodes: Vec::with_capacity(online.len()),
            nodes_by_signature: BTreeMap::new(),
        };
        // Gathered first, then each class's set built at once (sorted in one go, not an insert
        // per GPU).
        let mut free_by_class = vec![Vec::new(); index.classes.len()];
        let mut last: Option<(GpuClass, usize)> = None;
        for (node_number, node) in online.into_iter().enumerate() {
            let mut slots: Vec<_> = usable(node).collect();
            slots.sort_by(|a, b| a.uuid.cmp(&b.uuid));
            let start = index.gpus.len();
            for slot in slots {
                let class = class_of(slot);
                let class = match last {
                    Some((last, number)) if last == class => number,
                    _ => index.class_number(&class),
                };
                last = Some((index.classes[class], class));
                let number = index.gpus.len();
                let free = slot.free_places();
                if free > 0 {
                    free_by_class[class].push((free, number));
                }
                index.gpus.push(Gpu {
                    uuid: &slot.uuid,
                    node: node_number,
                    class,
                    free,
                });
            }
            let gpus = start..index.gpus.len();
            let signature = index.signature_of(gpus.clone());
            if !signature.is_empty() {
                index
                    .nodes_by_signature
                    .entry(signature.clone())
                    .or_default()
                    .insert(node_number);
            }
            index.nodes.push(Node {
                name: &node.name,
                gpus,
                signature,
            });
        }
        index.free_by_class = free_by_class.into_iter().map(BTreeSet::from_iter).collect();
        index.tags = std::mem::take(&mut tags);
        index
    }

    fn class_number(&self, class: &GpuClass) -> usize {
        // Every class was collected from the same GPUs, so the search always succeeds.
        self.classes
            .binary_search(class)
            .unwrap_or_else(|position| position)
    }

    fn signature_of(&self, gpus: Range<usize>) -> Signature {
        let mut signature: Signature = Vec::new();
        let mut classes: Vec<usize> = self.gpus[gpus]
            .iter()
            .filter(|gpu| gpu.free > 0)
            .map(|gpu| gpu.class)
            .collect();
        classes.sort_unstable();
        for class in classes {
            match signature.last_mut() {
                Some((last, count)) if *last == class => *count += 1,
                _ => signature.push((class, 1)),
            }
        }
        signature
    }

    /// Which classes fit the request, by class number, for `who` under the site's policy.
    pub fn fitting_classes(&self, request: &GpuRequest, who: &Who<'_>) -> Vec<bool> {
        self.classes
            .iter()
            .map(|class| {
                class.fits(request) && self.policy.allows(&self.tags[class.tag], who, self.now)
            })
            .collect()
    }

    /// Of `fits`, the classes of GPUs owned by `who`'s group.
    pub fn owned_classes(&self, fits: &[bool], who: &Who<'_>) -> Vec<bool> {
        self.classes
            .iter()
            .zip(fits)
            .map(|(class, &fits)| fits && Policy::owned_by(&self.tags[class.tag], who))
            .collect()
    }

    /// Whether some GPU in the index is owned by any group.
    pub fn any_owned(&self) -> bool {
        self.tags.iter().any(|tag| tag.owner.is_some())
    }

    /// Whether some GPU in the index is owned by `who`'s group.
    pub fn owns_some(&self, who: &Who<'_>) -> bool {
        self.tags.iter().any(|tag| Policy::owned_by(tag, who))
    }

    pub fn node_named(&self, name: &NodeName) -> Option<usize> {
        self.nodes.binary_search_by(|node| node.name.cmp(name)).ok()
    }

    pub fn node_name(&self, node: usize) -> &'a NodeName {
        self.nodes[node].name
    }

    pub fn node_of(&self, gpu: usize) -> usize {
        self.gpus[gpu].node
    }

    /// The UUIDs of these GPUs, in the same order.
    pub fn uuids(&self, gpus: &[usize]) -> Vec<GpuUuid> {
        gpus.iter()
            .map(|&gpu| self.gpus[gpu].uuid.clone())
            .collect()
    }

    /// The number of the GPU `uuid` of `node`, if it is one of its healthy, undrained GPUs.
    pub fn gpu_on(&self, node: usize, uuid: &GpuUuid) -> Option<usize> {
        let gpus = self.nodes[node].gpus.clone();
        let first = gpus.start;
        self.gpus[gpus]
            .binary_search_by(|gpu| gpu.uuid.cmp(uuid))
            .ok()
            .map(|offset| first + offset)
    }

    /// The node's GPUs, by number (in UUID order).
    pub fn gpus_of(&self, node: usize) -> Range<usize> {
        self.nodes[node].gpus.clone()
    }

    pub fn gpu_count(&self) -> usize {
        self.gpus.len()
    }

    pub fn node_count(&self) -> usize {
        self.nodes.len()
    }

    pub fn class_count(&self) -> usize {
        self.classes.len()
    }

    pub fn free(&self, gpu: usize) -> u32 {
        self.gpus[gpu].free
    }

    pub fn class_of(&self, gpu: usize) -> usize {
        self.gpus[gpu].class
    }

    /// The site's least capable fitting GPU with a free place; among equals the fullest (pack
    /// shared GPUs), then by node name and UUID.
    pub fn least_free_gpu(&self, fits: &[bool]) -> Option<usize> {
        self.free_by_class
            .iter()
            .zip(fits)
            .filter(|(_, fits)| **fits)
            .find_map(|(free, _)| free.first().map(|&(_, gpu)| gpu))
    }

    /// The node's `count` least capable fitting GPUs with a free place, least first; among
    /// equals the fullest, then by UUID. `None` when the node has fewer.
    pub fn least_free_gpus_on(&self, node: usize, fits: &[bool], count: u32) -> Option<Vec<usize>> {
        let mut candidates: Vec<(usize, u32, usize)> = self.nodes[node]
            .gpus
            .clone()
            .filter(|&gpu| self.gpus[gpu].free > 0 && fits[self.gpus[gpu].class])
            .map(|gpu| (self.gpus[gpu].class, self.gpus[gpu].free, gpu))
            .collect();
        let count = usize::try_from(count).ok()?;
        if candidates.len() < count {
            return None;
        }
        candidates.sort_unstable();
        Some(candidates[..count].iter().map(|&(_, _, gpu)| gpu).collect())
    }

    /// Exactly the GPUs `wanted` of the node, when there are `count` of them and each is there,
    /// fits and has a free place; `None` otherwise.
    pub fn these_free_gpus_on(
        &self,
        node: usize,
        fits: &[bool],
        wanted: &[GpuUuid],
        count: u32,
    ) -> Option<Vec<usize>> {
        if wanted.is_empty() || usize::try_from(count).ok()? != wanted.len() {
            return None;
        }
        let chosen: Vec<usize> = wanted
            .iter()
            .map(|uuid| {
                self.nodes[node].gpus.clone().find(|&gpu| {
                    let slot = &self.gpus[gpu];
                    slot.uuid == uuid && slot.free > 0 && fits[slot.class]
                })
            })
            .collect::<Option<_>>()?;
        let distinct: BTreeSet<usize> = chosen.iter().copied().collect();
        (distinct.len() == chosen.len()).then_some(chosen)
    }

    /// The node whose `count` least capable fitting free GPUs are least capable as a set:
    /// the sets' classes are compared from the most capable down, then node names.
    pub fn best_node(&self, fits: &[bool], count: u32) -> Option<usize> {
        let mut best: Option<(Vec<usize>, usize)> = None;
        let mut spare = Vec::new();
        for (signature, nodes) in &self.nodes_by_signature {
            let Some(&node) = nodes.first() else { continue };
            let mut chosen = std::mem::take(&mut spare);
            if !least_classes(signature, fits, count, &mut chosen) {
                spare = chosen;
                continue;
            }
            match &mut best {
                Some((best_classes, best_node))
                    if chosen
                        .iter()
                        .rev()
                        .cmp(best_classes.iter().rev())
                        .then(node.cmp(best_node))
                        .is_lt() =>
                {
                    spare = std::mem::replace(best_classes, chosen);
                    *best_node = node;
                }
                Some(_) => spare = chosen,
                None => best = Some((chosen, node)),
            }
        }
        best.map(|(_, node)| node)
    }

    /// Gives one place on each of `gpus` (all on `node`, each with a free place) to a session.
    pub fn take(&mut self, node: usize, gpus: &[usize]) {
        let mut filled = false;
        for &number in gpus {
            let gpu = &mut self.gpus[number];
            debug_assert!(
                gpu.node == node && gpu.free > 0,
                "took a full or foreign GPU"
            );
            self.free_by_class[gpu.class].remove(&(gpu.free, number));
            gpu.free -= 1;
            if gpu.free > 0 {
                self.free_by_class[gpu.class].insert((gpu.free, number));
            } else {
                filled = true;
            }
        }
        if !filled {
            return;
        }
        let signature = self.signature_of(self.nodes[node].gpus.clone());
        let old = std::mem::replace(&mut self.nodes[node].signature, signature.clone());
        if let Some(group) = self.nodes_by_signature.get_mut(&old) {
            group.remove(&node);
            if group.is_empty() {
                self.nodes_by_signature.remove(&old);
            }
        }
        if !signature.is_empty() {
            self.nodes_by_signature
                .entry(signature)
                .or_default()
                .insert(node);
        }
    }
}

/// Fills `chosen` with the classes of the `count` least capable fitting GPUs a node with this
/// signature has, least first. False when it has fewer than `count`.
fn least_classes(
    signature: &Signature,
    fits: &[bool],
    count: u32,
    chosen: &mut Vec<usize>,
) -> bool {
    chosen.clear();
    let mut wanted = count;
    for &(class, gpus) in signature {
        if wanted == 0 {
            break;
        }
        if fits[class] {
            let take = gpus.min(wanted);
            chosen.extend(std::iter::repeat_n(class, take as usize));
            wanted -= take;
        }
    }
    wanted == 0
}
