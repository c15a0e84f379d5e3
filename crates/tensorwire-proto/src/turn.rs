//! The connection's turn to send a large tensor's DATA (spec §7.4): tensors sent at once
//! take it first come, first served, so the receiver admits and fills one at a time instead
//! of spreading its credit and staging over all of them.

use std::collections::VecDeque;

/// A tensor's place in its connection's queue for the turn
/// ([`Session::queue_for_turn`](crate::Session::queue_for_turn)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TurnTicket(u64);

/// Who holds the turn (the front) and who waits for it, in the order they asked.
#[derive(Debug, Default)]
pub(crate) struct TurnQueue {
    next: u64,
    queue: VecDeque<TurnTicket>,
}

impl TurnQueue {
    /// A new place at the back of the queue.
    pub(crate) fn join(&mut self) -> TurnTicket {
        let ticket = TurnTicket(self.next);
        self.next += 1;
        self.queue.push_back(ticket);
        ticket
    }

    /// Whether `ticket` holds the turn.
    pub(crate) fn holds(&self, ticket: TurnTicket) -> bool {
        self.queue.front() == Some(&ticket)
    }

    /// Gives up `ticket`'s place, held or waited for; whether the turn passed to the next
    /// waiter (who should be woken). A place already given up is ignored.
    pub(crate) fn leave(&mut self, ticket: TurnTicket) -> bool {
        let Some(at) = self.queue.iter().position(|&t| t == ticket) else {
            return false;
        };
        self.queue.remove(at);
        at == 0 && !self.queue.is_empty()
    }

    /// Tensors holding or waiting for the turn.
    pub(crate) fn len(&self) -> usize {
        self.queue.len()
    }
}
