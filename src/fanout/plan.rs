//! The shape of a fan-out: a tree of degree D over the replicas, rooted at
//! the origin. Pure: no I/O, no clock.

/// One replica's place in the tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Place {
    /// The replica it pulls from (`None`: the origin).
    pub parent: Option<usize>,
    /// 1 for the origin's children.
    pub depth: u32,
    /// The replicas that pull from it.
    pub children: Vec<usize>,
}

/// Plans the tree for `n` replicas: they fill it breadth first in the
/// given order, and the origin and every relay get at most `degree`
/// children, so the tree is as shallow as that degree allows. A parent
/// always comes before its children.
pub fn plan(n: usize, degree: usize) -> Vec<Place> {
    let degree = degree.max(1);
    let mut places: Vec<Place> = Vec::with_capacity(n);
    for i in 0..n {
        let parent = (i >= degree).then(|| i / degree - 1);
        let depth = parent.map_or(1, |p| places[p].depth + 1);
        if let Some(p) = parent {
            places[p].children.push(i);
        }
        places.push(Place {
            parent,
            depth,
            children: Vec::new(),
        });
    }
    places
}

/// The replicas above `i`, nearest first, up to (not including) the
/// origin.
pub fn ancestors(places: &[Place], i: usize) -> Vec<usize> {
    let mut up = Vec::new();
    let mut at = places[i].parent;
    while let Some(p) = at {
        up.push(p);
        at = places[p].parent;
    }
    up
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The depth of the shallowest tree of degree `d` holding `n` nodes
    /// below its root: the least h with d + d² + … + d^h ≥ n.
    fn least_depth(n: usize, d: usize) -> u32 {
        let (mut h, mut held, mut level) = (0u32, 0usize, 1usize);
        while held < n {
            h += 1;
            level = level.saturating_mul(d);
            held = held.saturating_add(level);
        }
        h
    }

    #[test]
    fn six_replicas_of_degree_two() {
        let p = plan(6, 2);
        let parents: Vec<_> = p.iter().map(|x| x.parent).collect();
        assert_eq!(
            parents,
            [None, None, Some(0), Some(0), Some(1), Some(1)],
            "the origin feeds two, each of them two"
        );
        assert_eq!(ancestors(&p, 5), vec![1]);
        assert!(ancestors(&p, 0).is_empty());
        assert_eq!(plan(7, 2)[6].parent, Some(2));
        assert_eq!(ancestors(&plan(7, 2), 6), vec![2, 0]);
    }

    proptest! {
        #[test]
        fn every_replica_once_degree_kept_depth_least(n in 0usize..300, d in 1usize..9) {
            let p = plan(n, d);
            prop_assert_eq!(p.len(), n);
            let roots = p.iter().filter(|x| x.parent.is_none()).count();
            prop_assert!(roots <= d, "the origin serves at most {} replicas", d);
            let mut seen = vec![0; n];
            for (i, x) in p.iter().enumerate() {
                prop_assert!(x.children.len() <= d);
                for &c in &x.children {
                    seen[c] += 1;
                    prop_assert_eq!(p[c].parent, Some(i));
                    prop_assert!(c > i, "a parent comes before its children");
                    prop_assert_eq!(p[c].depth, x.depth + 1);
                }
                if x.parent.is_none() {
                    seen[i] += 1;
                }
                prop_assert_eq!(ancestors(&p, i).len() as u32, x.depth - 1);
            }
            prop_assert!(seen.iter().all(|&s| s == 1), "every replica has exactly one parent");
            let depth = p.iter().map(|x| x.depth).max().unwrap_or(0);
            prop_assert_eq!(depth, least_depth(n, d));
        }
    }
}
