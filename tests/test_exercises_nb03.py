"""Notebook 03's exercise checks, and the wrong answers each must catch."""

import torch
from exercises import nb03
from helpers import check_tests


# rebinds a new tensor: the caller's is untouched
def write_by_cat(k_store, v_store, layer, start, k, v):
    k_store = torch.cat([k_store[layer, :, :start], k.transpose(0, 1)], dim=1)
    v_store = torch.cat([v_store[layer, :, :start], v.transpose(0, 1)], dim=1)


def write_with_clone(k_store, v_store, layer, start, k, v):  # right slots, but a copy on the way
    n = k.shape[0]
    k_store[layer, :, start:start + n] = k.transpose(0, 1).contiguous()
    v_store[layer, :, start:start + n] = v.transpose(0, 1).contiguous()


# writes as if the store were [L, S, H, D]
def write_seq_layout(k_store, v_store, layer, start, k, v):
    n = k.shape[0]
    k_store[layer, :, start:start + n] = k.reshape(k_store.shape[1], n, -1)
    v_store[layer, :, start:start + n] = v.reshape(v_store.shape[1], n, -1)


def view_copy(k_store, layer, seq):  # right values, but a copy
    return k_store[layer, :, :seq].unsqueeze(0).clone()


def view_wrong_layer(k_store, layer, seq):
    return k_store[(layer + 1) % k_store.shape[0], :, :seq].unsqueeze(0)


def view_seq_axis(k_store, layer, seq):  # permutes as if the store were [L, S, H, D]
    return k_store[layer].permute(1, 0, 2)[:, :seq].unsqueeze(0)


def predict_in_elements():  # counts elements, not bytes
    return 256, (64, 4, 1)


def predict_seq_strides():  # the strides of the "seq" layout
    return 1024, (4, 8, 1)


def predict_sliced_strides():  # as if the slice to 5 slots were a new, packed tensor
    return 1024, (20, 4, 1)


def predict_one_number():
    return 1024


CASES = [
    (nb03.check_write, nb03.write_solution, [write_by_cat, write_with_clone, write_seq_layout]),
    (nb03.check_view, nb03.view_solution, [view_copy, view_wrong_layer, view_seq_axis]),
    (nb03.check_view_prediction, nb03.view_prediction_solution,
     [predict_in_elements, predict_seq_strides, predict_sliced_strides, predict_one_number]),
]


class RingWithoutWrap(nb03.RingCacheSolution):  # stops at the last slot: keeps overwriting it
    def write(self, layer, pos, k, v):
        self.k[layer, :, min(pos, self.window - 1)] = k[0]
        self.v[layer, :, min(pos, self.window - 1)] = v[0]


class RingViewsEverySlot(nb03.RingCacheSolution):  # reads the zeros of slots not written yet
    def view(self, layer, seq):
        return self.k[layer].unsqueeze(0), self.v[layer].unsqueeze(0)


class RingInTimeOrder(nb03.RingCacheSolution):  # right values, but torch.roll copies
    def view(self, layer, seq):
        keys, values = super().view(layer, seq)
        shift = -(seq % self.window) if seq > self.window else 0
        return keys.roll(shift, 2), values.roll(shift, 2)


class RingByCat(nb03.RingCacheSolution):  # a new store at every write
    def write(self, layer, pos, k, v):
        slot = pos % self.window
        for store, new in ((self.k, k), (self.v, v)):
            store[layer] = torch.cat([store[layer][:, :slot], new.transpose(0, 1),
                                      store[layer][:, slot + 1:]], 1)


CASES.append((nb03.check_ring_cache, nb03.RingCacheSolution,
              [RingWithoutWrap, RingViewsEverySlot, RingInTimeOrder, RingByCat]))

test_check = check_tests(nb03, CASES)
